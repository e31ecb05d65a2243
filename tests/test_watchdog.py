"""The watchdog: a stopped rank and a dead rank are named (rank, component, host), every rank's
stack lands in RUN_DIR/stacks, the job ends within seconds; a long call is not a hang."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rlinf_hpc.runtime import accounting, disk, oomkill
from rlinf_hpc.runtime.heartbeat import Heartbeat
from rlinf_hpc.runtime.watchdog import Watchdog

from conftest import BIN, job_env, probe_toml, rlinf, start_job, survivors, wait_for_pids

pytestmark = pytest.mark.mpi

FAST = "[watchdog]\nheartbeat_s = 1.0\nhang_timeout_s = 6.0\n"


def _finish(proc: subprocess.Popen[str], within: float) -> str:
    try:
        out, _ = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the job did not end within {within} s")
    return out


def _segment_names(pids: list[int]) -> list[str]:
    """The names in /dev/shm of the MPICH segments the job's ranks map. MPICH unlinks them in
    MPI_Finalize only, so a killed or aborted job left them behind (2 per run of these tests)."""
    mapped = set()
    for pid in pids:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            if "/dev/shm/mpich_shm_" in line:
                mapped.add(line.split(maxsplit=5)[5])
    assert mapped, "the ranks map no MPICH segment (not MPICH's shared memory any more?)"
    return [name for name in mapped if not name.endswith("(deleted)")]


def test_a_stopped_rank_is_named_with_every_stack_and_ends_the_job(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_job([str(BIN / "rlinf-hpc"), "run", str(probe_toml(tmp_path, "signal_flow", extra=FAST)),
                      "--run-dir", str(run_dir)])  # fmt: skip
    pids, _ = wait_for_pids(proc)
    assert _segment_names(pids) == []  # removed once every rank attached: nothing can leak
    victim = pids[2]  # beta's rank, idle
    stopped = time.monotonic()
    os.kill(victim, signal.SIGSTOP)
    try:
        out = _finish(proc, 6.0 + 5.0 + 20.0)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    took = time.monotonic() - stopped
    assert proc.returncode != 0, out
    assert f"rank 2 (beta) on {os.uname().nodename}, pid {victim}: no heartbeat for" in out, out
    assert took < 6.0 + 5.0 + 10.0, took  # hang_timeout_s + a beat + the stack collection
    stacks = {p.name: p.read_text() for p in (run_dir / "stacks").glob("rank-*.txt")}
    assert {"rank-0.txt", "rank-1.txt", "rank-2.outside.txt"} <= set(stacks), stacks
    assert "in sleep" in stacks["rank-1.txt"]  # alpha is busy in the flow's long call
    # the stopped rank was read from outside and never resumed: it did not dump its own stack
    # (its heartbeat thread would have, at its next beat), and it was still stopped when read
    assert "rank-2.txt" not in stacks, stacks["rank-2.txt"]
    assert "State:\tT (stopped)" in stacks["rank-2.outside.txt"], stacks["rank-2.outside.txt"]
    assert "Thread" in stacks["rank-2.outside.txt"]  # py-spy's Python stack of it
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "rank stopped" and summary["culprit"]["rank"] == 2
    assert summary["culprit"]["component"] == "beta"
    assert not survivors(pids, grace=10.0)


def test_a_long_call_is_not_a_hang(tmp_path: Path) -> None:
    """alpha sleeps 3 s, longer than 3 heartbeats: the watchdog must not fire."""
    extra = "[watchdog]\nheartbeat_s = 0.5\nhang_timeout_s = 1.5\n"
    result = rlinf(
        "run", str(probe_toml(tmp_path, "idle_flow", extra=extra)), "--run-dir", str(tmp_path / "r")
    )
    assert result.returncode == 0, result.output
    assert "no heartbeat" not in result.output


def test_a_rank_stuck_in_a_collective_is_named_with_the_rank_missing_from_it(tmp_path: Path) -> None:
    """alpha's rank 2 waits in a broadcast whose root (rank 1) never enters it: within
    hang_timeout_s + a few seconds the job ends, naming the operation and the missing rank."""
    extra = "[watchdog]\nheartbeat_s = 0.5\nhang_timeout_s = 4.0\n"
    run_dir = tmp_path / "r"
    started = time.monotonic()
    config = probe_toml(tmp_path, "stuck_flow", alpha=2, extra=extra)
    result = rlinf("run", str(config), "--run-dir", str(run_dir), timeout=60)
    took = time.monotonic() - started
    assert result.returncode != 0, result.output
    assert "rank 2 (alpha)" in result.output and "waits in broadcast #1 over ranks [1, 2]" in result.output
    assert "missing from it: rank 1 (alpha): idle for" in result.output, result.output
    assert took < 40, took  # start-up, 4 s, the stack collection, the end
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["culprit"]["rank"] == 2 and summary["culprit"]["error"] == "stuck"
    assert (run_dir / "stacks" / "rank-2.txt").read_text().count("broadcast") >= 1


def test_a_long_wait_on_a_working_peer_is_not_a_hang(tmp_path: Path) -> None:
    """Rank 2 waits 4 s for rank 1, which works (sleeps) meanwhile: no alarm at hang_timeout_s 2."""
    extra = "[watchdog]\nheartbeat_s = 0.5\nhang_timeout_s = 2.0\n"
    result = rlinf("run", str(probe_toml(tmp_path, "late_send_flow", alpha=2, extra=extra)), "--run-dir",
                   str(tmp_path / "r"))  # fmt: skip
    assert result.returncode == 0, result.output
    assert "waits in" not in result.output


def test_watchdog_finds_dead_and_silent_ranks_from_heartbeat_files(tmp_path: Path) -> None:
    """The watch's decisions on their own, with heartbeat files written here."""
    beat = Heartbeat(tmp_path, 1, interval=0.2)
    beat.doing("actor.update", "actor")
    fatal: list[tuple[str, dict]] = []
    watch = Watchdog(
        tmp_path,
        4,
        hang_timeout_s=5.0,
        interval=0.2,
        action="abort",
        on_fatal=lambda m, c: fatal.append((m, c)),
    )
    try:
        dead = subprocess.Popen(["true"])
        dead.wait()
        for rank, pid, age in ((2, dead.pid, 0.0), (3, os.getpid(), 30.0)):
            then = time.time() - age
            record = {"rank": rank, "pid": pid, "host": os.uname().nodename, "time": then,
                      "roles": "rollout", "activity": "rollout.generate", "since": then}  # fmt: skip
            (tmp_path / "heartbeats" / f"rank-{rank}.json").write_text(json.dumps(record))
        problems = watch.check()
        assert sorted((p["rank"], p["kind"]) for p in problems) == [(2, "died"), (3, "stopped")]
        deadline = time.monotonic() + 15
        while not fatal and time.monotonic() < deadline:
            time.sleep(0.1)
        assert fatal and "rank 2 (rollout)" in fatal[0][0] and "died while in rollout.generate" in fatal[0][0]
        assert fatal[0][1]["rank"] == 2
        assert "rank-1.txt" in {p.name for p in (tmp_path / "stacks").iterdir()}  # rank 1 answered
    finally:
        watch.close()
        beat.close()
    assert json.loads((tmp_path / "heartbeats" / "rank-1.json").read_text())["left"]


def test_ranks_found_dead_together_are_named_in_the_order_the_death_watch_saw_them_exit(
    tmp_path: Path,
) -> None:
    """Over OFI a killed rank's peers abort within milliseconds of it, so the watchdog finds
    several dead at once: the death watch's exit order (heartbeats/exits.jsonl) names the killed
    one first, not the lowest rank (rank 1 for a killed rank 3 in the hetjob test)."""
    from rlinf_hpc.runtime.deathwatch import EXITS, exit_order

    fatal: list[tuple[str, dict]] = []
    watch = Watchdog(tmp_path, 5, hang_timeout_s=60.0, interval=60.0, action="abort",
                     on_fatal=lambda m, c: fatal.append((m, c)))  # fmt: skip
    try:
        dead = subprocess.Popen(["true"])
        dead.wait()
        beats = tmp_path / "heartbeats"
        beats.mkdir()
        for rank in (1, 2, 3):
            record = {"rank": rank, "pid": dead.pid, "host": os.uname().nodename, "time": time.time(),
                      "roles": "policy" if rank == 3 else "env", "activity": "idle"}  # fmt: skip
            (beats / f"rank-{rank}.json").write_text(json.dumps(record))
        assert [p["rank"] for p in watch.check()] == [1, 2, 3]  # no exits seen: rank order
        (beats / EXITS).write_text('{"time": 1.0, "ranks": [3]}\nnot json\n{"time": 1.1, "ranks": [2]}\n')
        assert exit_order(beats) == {3: 0, 2: 2}
        assert [p["rank"] for p in watch.check()] == [3, 2, 1]  # seen first; unseen last
        watch.fail_if_dead("then the coordinator failed")
        assert fatal and fatal[0][1]["rank"] == 3 and fatal[0][0].startswith("rank 3 (policy)")
    finally:
        watch.close()


def test_a_ranks_first_activity_is_on_disk_before_the_next_beat(tmp_path: Path) -> None:
    """A coordinator killed in its first seconds was reported "starting": its first activity
    waited for the next beat (2 s by default). Later activities still wait for it."""
    beat = Heartbeat(tmp_path, 0, interval=60.0)
    path = tmp_path / "heartbeats" / "rank-0.json"
    try:
        assert json.loads(path.read_text())["activity"] == "starting"
        beat.doing("coordinating")
        record = json.loads(path.read_text())
        assert (record["activity"], record["roles"]) == ("coordinating", "coordinator")
        beat.doing("step 1")
        assert json.loads(path.read_text())["activity"] == "coordinating"  # no write per activity
    finally:
        beat.close()


@pytest.mark.parametrize(("victim", "name"), [(2, "beta"), (0, "coordinator")])
def test_a_killed_rank_is_named_not_just_a_pid(tmp_path: Path, victim: int, name: str) -> None:
    """kill -9 takes every rank down at once; the death watch still names the first to die."""
    run_dir = tmp_path / "run"
    proc = start_job([str(BIN / "rlinf-hpc"), "run", str(probe_toml(tmp_path, "signal_flow", extra=FAST)),
                      "--run-dir", str(run_dir)])  # fmt: skip
    pids, _ = wait_for_pids(proc)
    assert _segment_names(pids) == []  # a killed rank leaves no shared memory in /dev/shm
    ready = run_dir / "heartbeats" / "deathwatch.json"
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ready.exists(), "the death watch never started"
    killed = time.monotonic()
    os.kill(pids[victim], signal.SIGKILL)
    out = _finish(proc, 30.0)
    assert time.monotonic() - killed < 5.0
    named_first = f"rank {victim} ({name}) on {os.uname().nodename}, pid {pids[victim]}, died"
    assert named_first in out or f"rank {victim} ({name}, pid {pids[victim]}, in" in out, out
    # named alone, or -- when its exit and the launcher's kills were seen in one wake-up -- among
    # the exits of that instant, never replaced by another rank
    summary = json.loads((run_dir / "summary.json").read_text())
    culprit = summary["culprit"]
    named = [culprit["rank"], *[c["rank"] for c in culprit.get("simultaneous", [])]]
    assert summary["outcome"] == "rank died" and victim in named, summary
    # seen alone at the first wake-up (its pidfd is ready before the launcher learns of the
    # exit and kills the rest): it is the one named as having died, whatever its rank
    # (the report sorted its candidates and named the coordinator for a killed rank 2)
    if culprit["seen_first"] == [victim]:
        assert culprit["rank"] == victim, summary
    if victim != culprit["rank"]:
        assert "any of them may have been first" in out, out
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    died = [e["culprit"] for e in events if e["event"] == "rank_died"]
    ends = [e["culprit"] for e in events if e["event"] == "end"]
    assert died == [culprit] and ends == [culprit], events  # one account, everywhere, once
    assert name in [culprit["component"], *[c["component"] for c in culprit.get("simultaneous", [])]]
    assert not survivors(pids, grace=5.0)


@pytest.fixture
def small_memory_cgroup() -> Any:
    """A child of this process's memory cgroup limited to 200 MB (no swap); skipped where this
    user may not make one (not root, no writable memory controller)."""
    cgroup = oomkill.memory_cgroup(
        Path("/proc/self/cgroup").read_text(), Path("/proc/self/mountinfo").read_text()
    )
    if cgroup is None:
        pytest.skip("no memory cgroup")
    child = cgroup / f"rlinf-oom-test-{os.getpid()}"
    limits = [("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"), ("memory.max", "memory.swap.max")]
    try:
        child.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup under {cgroup}: {exc}")
    try:
        for limit, swap in limits:
            if (child / limit).exists():
                (child / limit).write_text(str(200 << 20))
                if (child / swap).exists():
                    (child / swap).write_text(str(200 << 20) if limit.endswith("bytes") else "0")
                break
        else:
            pytest.skip(f"{child} has no memory limit to set (controller not enabled there)")
        yield child
    except OSError as exc:
        pytest.skip(f"cannot limit the memory of {child}: {exc}")
    finally:
        deadline = time.monotonic() + 10
        while child.exists() and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                child.rmdir()  # once the killed rank is gone from it
            time.sleep(0.2)


def test_a_rank_the_oom_killer_ends_is_named_with_the_cause_and_the_fix(
    tmp_path: Path, small_memory_cgroup: Path
) -> None:
    """The kernel's OOM killer sends SIGKILL: before, the job said "killed, or a crash below
    Python" and the user had to guess. Now the death report says it was the OOM killer, which
    limit, and what to change."""
    run_dir = tmp_path / "run"
    extra = "[watchdog]\nheartbeat_s = 0.2\nhang_timeout_s = 30.0\n"
    env = job_env({"RLINF_TEST_OOM_CGROUP": str(small_memory_cgroup), "MPIEXEC_TIMEOUT": "90"})
    started = time.monotonic()
    result = rlinf(
        "run", str(probe_toml(tmp_path, "oom_flow", extra=extra)), "--run-dir", str(run_dir), env=env
    )
    assert time.monotonic() - started < 60
    assert result.returncode != 0, result.output
    assert "killed by the kernel's OOM killer" in result.output, result.output
    assert "rank 1 (alpha)" in result.output and "sbatch --mem" in result.output, result.output
    culprit = json.loads((run_dir / "summary.json").read_text())["culprit"]
    assert (culprit["rank"], culprit["component"], culprit["cause"]) == (1, "alpha", "oom_kill"), culprit
    assert "200 MB" in culprit["cause_detail"], culprit  # the cgroup's limit, read from it
    ends = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(
        e.get("culprit", {}).get("cause") == "oom_kill" for e in ends if e["event"] in ("end", "rank_died")
    )
    # where the kernel log is not readable (not root, kernel.dmesg_restrict = 1), the count of
    # the cgroup the rank's last heartbeat named still tells
    last_beat = json.loads((run_dir / "heartbeats" / "rank-1.json").read_text())
    assert last_beat["cgroup"] == str(small_memory_cgroup), last_beat
    cause = oomkill.death_cause(last_beat, kmsg="")
    assert cause and "most likely killed by the kernel's OOM killer" in cause["detail"], (cause, last_beat)


def test_a_rank_that_crashes_below_python_is_named_with_the_crash_and_where(tmp_path: Path) -> None:
    """A segfault in a C extension: faulthandler was off, so the job said "killed, or a crash
    below Python" with no stack. Now the report names the signal and the Python frame, and every
    thread's stack is in the rank's crash file; ranks that left normally leave no such file."""
    run_dir = tmp_path / "run"
    result = rlinf("run", str(probe_toml(tmp_path, "crash_flow", extra=FAST)), "--run-dir", str(run_dir))
    assert result.returncode != 0, result.output
    said = "rank 1 (alpha) on"
    assert (
        said in result.output
        and "crashed below Python: Fatal Python error: Segmentation fault" in result.output
    )
    assert "in string_at (" in result.output and "<- segfault (" in result.output, result.output
    culprit = json.loads((run_dir / "summary.json").read_text())["culprit"]
    assert (culprit["rank"], culprit["cause"]) == (1, "crash"), culprit
    crash = (run_dir / "heartbeats" / "rank-1.crash").read_text()
    assert "Segmentation fault" in crash and "in serve" in crash, crash  # every frame, down to the loop
    clean = tmp_path / "clean"
    assert rlinf("run", str(probe_toml(tmp_path, "idle_flow")), "--run-dir", str(clean)).returncode == 0
    assert not list((clean / "heartbeats").glob("*.crash"))


def test_a_nearly_full_memory_cgroup_is_warned_of_with_the_ranks_holding_most(
    tmp_path: Path, small_memory_cgroup: Path
) -> None:
    """Before the OOM killer: a rank holds 170 MB of its cgroup's 200 MB; the job warns, names
    it, records a `memory_pressure` event and goes on (a warning, not a failure)."""
    run_dir = tmp_path / "run"
    extra = "[watchdog]\nheartbeat_s = 0.2\nhang_timeout_s = 30.0\nmemory_warn_fraction = 0.8\n"
    env = job_env({"RLINF_TEST_OOM_CGROUP": str(small_memory_cgroup), "MPIEXEC_TIMEOUT": "90"})
    config = probe_toml(tmp_path, "memory_pressure_flow", extra=extra)
    result = rlinf("run", str(config), "--run-dir", str(run_dir), env=env)
    assert result.returncode == 0, result.output
    assert f"memory: the memory cgroup {small_memory_cgroup} on" in result.output, result.output
    assert "of 200 MB): the kernel's OOM killer ends a rank at 100%" in result.output, result.output
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    warned = [e for e in events if e["event"] == "memory_pressure" and e["scope"] == str(small_memory_cgroup)]
    assert len(warned) == 1, warned  # once, not at every beat
    assert warned[0]["ranks"][0][:2] == [1, "alpha"] and warned[0]["used_mb"] >= 160, warned


def test_memory_pressure_is_said_once_per_place_and_again_after_it_fell(tmp_path: Path) -> None:
    """`PressureWatch` alone: a cgroup and a node, the largest holders first, re-armed 5 points
    below the bound; a cgroup's working set leaves out inactive file cache (v1 and v2)."""
    watch = oomkill.PressureWatch(0.9)

    def beat(used: float, rss: float, roles: str, available: float = 20000.0) -> dict[str, Any]:
        node = {"node_total_mb": 24000.0, "node_available_mb": available}
        cgroup = {"cgroup": "/cg/step_0", "cgroup_used_mb": used, "cgroup_limit_mb": 1000.0}
        return {"host": "n1", "rss_mb": rss, "roles": roles, **node, **cgroup}

    assert watch.scan({1: beat(800, 300, "rollout"), 2: beat(800, 500, "actor")}) == []
    (warning,) = watch.scan({1: beat(920, 300, "rollout"), 2: beat(920, 600, "actor")})
    assert warning["scope"] == "/cg/step_0" and [r[0] for r in warning["ranks"]] == [2, 1], warning
    assert "92% full (920 of 1000 MB)" in oomkill.describe_pressure(warning)
    assert "rank 2 (actor) 600 MB, rank 1 (rollout) 300 MB" in oomkill.describe_pressure(warning)
    assert watch.scan({1: beat(950, 300, "rollout")}) == []  # said already
    assert watch.scan({1: beat(860, 300, "rollout")}) == []  # not 5 points below: still raised
    assert watch.scan({1: beat(840, 300, "rollout")}) == []  # fell: re-armed
    assert [w["scope"] for w in watch.scan({1: beat(910, 300, "rollout", available=1000.0)})] == [
        "/cg/step_0", "node",
    ]  # fmt: skip
    for usage, inactive_key in (
        ("memory.current", "inactive_file"),
        ("memory.usage_in_bytes", "total_inactive_file"),
    ):
        cgroup = tmp_path / usage
        cgroup.mkdir()
        (cgroup / usage).write_text(str(900 << 20))
        (cgroup / "memory.stat").write_text(f"active_file 1\n{inactive_key} {300 << 20}\nanon 5\n")
        assert oomkill.working_set_mb(cgroup) == 600.0


def test_the_oom_killers_evidence_is_read_from_the_kernel_log_or_the_cgroups_count(tmp_path: Path) -> None:
    """Each source on its own, from files written here: cgroup v1 and v2 paths, the kernel
    log's record (matched on pid and time: a recycled pid is not taken), the cgroup's count."""
    mountinfo = (
        "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
        "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
    )
    v1 = "4:memory:/slurm/uid_0/job_7/step_0\n0::/\n"
    assert oomkill.memory_cgroup(v1, mountinfo) == Path("/sys/fs/cgroup/memory/slurm/uid_0/job_7/step_0")
    only_v2 = "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n"
    assert oomkill.memory_cgroup("0::/system.slice/slurmstepd.scope/job_7\n", only_v2) == Path(
        "/sys/fs/cgroup/system.slice/slurmstepd.scope/job_7"
    )
    assert oomkill.memory_cgroup("0::/\n", only_v2) == Path("/sys/fs/cgroup")
    assert oomkill.memory_cgroup("0::/x\n", "") is None
    kmsg = (
        "6,420,100000000,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),task=python,pid=4242,uid=0\n"
        "3,421,100000100,-;Memory cgroup out of memory: Killed process 4242 (python) total-vm:9kB, "
        "anon-rss:2048000kB, file-rss:0kB\n"
        "3,430,200000000,-;Out of memory: Killed process 77 (rlinf-hpc) total-vm:9kB, anon-rss:1024kB, "
        "file-rss:0kB\n"
    )
    assert oomkill.kernel_kill_record(kmsg, 4242, after_s=50.0) == {
        "at_s": 100.0001, "name": "python", "rss_mb": 2000.0, "constraint": "CONSTRAINT_MEMCG",
    }  # fmt: skip
    assert oomkill.kernel_kill_record(kmsg, 4242, after_s=150.0) is None  # an older process of that pid
    cause = oomkill.death_cause({"pid": 77, "boot_s": 150.0}, kmsg=kmsg)
    assert cause and "the node ran out of memory" in cause["detail"], cause
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    (cgroup / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n")
    (cgroup / "memory.max").write_text(str(512 << 20))
    record = {"pid": 4242, "boot_s": 150.0, "cgroup": str(cgroup), "oom_kills": 1}
    cause = oomkill.death_cause(record, kmsg=kmsg)  # not in the log (after its start): the count
    assert cause and cause["detail"].startswith("most likely killed by the kernel's OOM killer"), cause
    assert "(512 MB) counted 1 OOM kill(s)" in cause["detail"], cause
    assert oomkill.death_cause({**record, "oom_kills": 2}, kmsg="") is None  # nothing since its last beat
    (cgroup / "memory.events").unlink()
    (cgroup / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert oomkill.oom_kills(cgroup) == 5


def _leak_job(tmp_path: Path, leak_mb: float, action: str = "warn") -> tuple[object, list[dict]]:
    config = tmp_path / "leak.toml"
    config.write_text(
        '[job]\nname = "leak"\nnum_ranks = 2\n'
        f"[watchdog]\nheartbeat_s = 0.1\nhang_timeout_s = 30\nleak_window = 10\nleak_mb_per_step = 2\n"
        f'leak_min_growth_mb = 40\nleak_action = "{action}"\n'
        f'[components.alpha]\nworker = "job_workers:LeakyWorker"\noptions = {{ leak_mb = {leak_mb} }}\n'
        '[flow]\nrunner = "job_workers:leak_flow"\n'
    )
    run_dir = tmp_path / f"run-{leak_mb}"
    result = rlinf("run", str(config), "--run-dir", str(run_dir), timeout=180)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return result, [e for e in events if e["event"] == "memory_leak"]


def test_an_injected_leak_is_reported_with_its_rate_and_a_healthy_run_is_not(tmp_path: Path) -> None:
    result, alarms = _leak_job(tmp_path, 8.0, action="free")
    assert result.returncode == 0, result.output  # type: ignore[attr-defined]
    assert alarms and alarms[0]["rank"] == 1 and alarms[0]["kind"] == "host", alarms
    assert abs(alarms[0]["mb_per_step"] - 8.0) <= 0.2 * 8.0, alarms  # within 20% of the truth
    assert "rank 1 (alpha)" in result.output and "MB/step" in result.output  # type: ignore[attr-defined]
    healthy, none = _leak_job(tmp_path, 0.0)
    assert healthy.returncode == 0 and none == [], none  # type: ignore[attr-defined]


def test_a_slow_rank_is_named_a_straggler_and_equal_ranks_are_not(tmp_path: Path) -> None:
    from rlinf_hpc.runtime.stragglers import StragglerDetector

    equal = StragglerDetector(window=4, ratio=1.5)
    assert not any(equal.observe(s, {("a", 1): 0.1, ("a", 2): 0.12, ("a", 3): 0.09}) for s in range(8))
    config = tmp_path / "slow.toml"
    config.write_text(
        '[job]\nname = "slow"\nnum_ranks = 3\n[watchdog]\nstraggler_window = 4\n'
        '[components.alpha]\nworker = "job_workers:SlowWorker"\nnum_ranks = 2\n'
        "options = { delay = 0.02, factor = 3.0 }\n"
        "[pipeline]\nmicro_batch = 2\nmin_micro_batch = 2\nmax_micro_batch = 2\nelastic = false\n"
        '[flow]\nrunner = "job_workers:straggler_flow"\n'
    )
    result = rlinf("run", str(config), "--run-dir", str(tmp_path / "run"), timeout=180)
    assert result.returncode == 0, result.output
    assert "straggler: rank 2 of 'alpha'" in result.output, result.output
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    found = [e for e in events if e["event"] == "straggler"]
    assert len(found) == 1 and found[0]["straggler_rank"] == 2 and found[0]["score"] > 1.5, found


def test_a_failing_heartbeat_figure_is_logged_once_and_the_beat_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in what a beat reports must not end the heartbeat thread (the watchdog would name
    the rank frozen two minutes later): it is logged once and the next beats still land."""
    from rlinf_hpc.runtime import heartbeat as module

    calls = {"n": 0}
    real = module.memory_in_use

    def flaky() -> dict:
        calls["n"] += 1
        if calls["n"] in (2, 3, 4):  # the thread's first three beats fail the same way
            raise AttributeError("module 'torch' has no attribute 'cuda'")
        return real()

    monkeypatch.setattr(module, "memory_in_use", flaky)
    beat = Heartbeat(tmp_path, 1, interval=0.05)
    try:
        deadline = time.monotonic() + 10
        while calls["n"] < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert calls["n"] >= 8 and beat._thread.is_alive()
        record = json.loads((tmp_path / "heartbeats" / "rank-1.json").read_text())
        assert time.time() - record["time"] < 5
    finally:
        beat.close()
    failures = [r for r in caplog.records if "heartbeat of rank 1 failed" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in caplog.records]


def test_a_worker_leaving_because_the_coordinator_died_says_it_left(tmp_path: Path) -> None:
    """A worker that sees rank 0 dead leaves on purpose: its last beat says ``left``, so the
    death watch does not take its exit for the death (it named such a worker instead of a
    killed rank 0 once, under load)."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    beats = tmp_path / "heartbeats"
    beats.mkdir()
    record = {"rank": 0, "pid": dead.pid, "host": os.uname().nodename, "time": time.time(),
              "roles": "coordinator", "activity": "flow", "since": time.time()}  # fmt: skip
    (beats / "rank-0.json").write_text(json.dumps(record))
    script = (
        "import sys, time\nfrom pathlib import Path\nfrom rlinf_hpc.runtime.heartbeat import Heartbeat\n"
        "Heartbeat(Path(sys.argv[1]), 2, interval=0.1)\ntime.sleep(30)\nsys.exit(5)\n"
    )
    done = subprocess.run(
        [str(BIN / "python"), "-c", script, str(tmp_path)], timeout=60, capture_output=True, text=True
    )
    assert done.returncode == 1, done.stderr
    assert "rank 0 (coordinator)" in done.stderr and "rank 2 leaves" in done.stderr
    assert json.loads((beats / "rank-2.json").read_text())["left"]


def test_the_death_watch_counts_a_zombie_or_an_exiting_process_as_gone() -> None:
    """A rank killed with its threads still being torn down is named among the exits the watch
    saw together (a killed coordinator outlived, for a moment, the workers that saw its sockets
    close); a running one is not."""
    from rlinf_hpc.runtime.deathwatch import _exiting

    child = subprocess.Popen(["sleep", "30"])
    try:
        assert not _exiting(child.pid)
        child.kill()
        deadline = time.monotonic() + 5
        while not _exiting(child.pid) and time.monotonic() < deadline:  # a zombie: not reaped
            time.sleep(0.01)
        assert _exiting(child.pid)
    finally:
        child.wait()
    assert _exiting(child.pid)  # reaped: gone


def test_a_killed_thread_or_a_pending_sigkill_counts_as_exiting(tmp_path: Path) -> None:
    """A killed process that has not run since (SIGKILL pending, in the process's or a thread's
    mask) or one of whose threads has begun to exit is counted with the exits the watch saw."""
    from rlinf_hpc.runtime.deathwatch import _task_exiting

    def proc(name: str, flags: int, sig: str = "0000000000000000", shd: str = "0000000000000000") -> Path:
        task = tmp_path / name
        task.mkdir()
        (task / "stat").write_text(f"4242 (py (x) y) S 1 4242 4242 0 -1 {flags} 0 0\n")
        (task / "status").write_text(f"Name:\tpy\nSigPnd:\t{sig}\nShdPnd:\t{shd}\nSigBlk:\t{'f' * 16}\n")
        return task

    assert not _task_exiting(proc("running", 0x400000))
    assert not _task_exiting(proc("sigterm", 0x400000, shd="0000000000004000"))  # not SIGKILL
    assert _task_exiting(proc("exiting", 0x400004))  # PF_EXITING
    assert _task_exiting(proc("shared", 0x400000, shd="0000000000000100"))  # kill(): the process
    assert _task_exiting(proc("thread", 0x400000, sig="0000000000004100"))  # a thread's own
    assert not _task_exiting(tmp_path / "gone")


def test_ranks_found_ending_as_the_first_exit_was_seen_are_named_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under mpiexec the launcher kills the other ranks at the first exit, before the watch
    looks: a killed worker was reported with every other rank "in the same instant". The ranks
    the watch saw exit together and those it found ending are told apart in the message."""
    from rlinf_hpc.runtime.deathwatch import _report

    beats = tmp_path / "heartbeats"
    beats.mkdir()
    (tmp_path / "summary.json").write_text(json.dumps({"run_id": "r1", "outcome": "running"}))
    for rank, roles in ((0, None), (1, "alpha"), (2, "beta"), (3, "gamma")):
        record = {"rank": rank, "pid": 100 + rank, "roles": roles, "activity": f"{roles}.run_stage"}
        (beats / f"rank-{rank}.json").write_text(json.dumps(record))
    pids = {0: 100, 1: 101, 2: 102, 3: 103}
    _report(tmp_path, "r1", [2, 3, 0, 1], pids, [2, 3])
    said = capsys.readouterr().err
    assert said.startswith("rlinf-hpc: rank 2 (beta) on"), said
    together, _, after = said.partition("already ending when it was seen")
    assert "in the same instant: rank 3 (gamma, pid 103, in gamma.run_stage)" in together, said
    assert "rank 0 (coordinator, pid 100" in after and "rank 1 (alpha, pid 101" in after, said
    assert "rank 0" not in together and "any of them may have been first" in after, said
    culprit = json.loads((tmp_path / "summary.json").read_text())["culprit"]
    assert culprit["rank"] == 2 and [c["rank"] for c in culprit["simultaneous"]] == [3, 0, 1], culprit


def test_ranks_dead_before_the_death_watch_began_are_its_first_wake_up(tmp_path: Path) -> None:
    """Under load the helper starts late: the coordinator, ended by the launcher for a crashed
    rank 1, was dead already, and the watch named it alone without looking at the ranks still
    tearing down (CI). Those dead at the start are a wake-up like any: the exits ready then, and
    the ranks exiting, are named with them."""
    beats = tmp_path / "heartbeats"
    beats.mkdir()
    (tmp_path / "summary.json").write_text(json.dumps({"run_id": "r1", "outcome": "running"}))
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: pidfd_open fails
    zombie = subprocess.Popen(["sleep", "30"])
    try:
        zombie.kill()
        for rank, pid, roles in ((0, dead.pid, None), (1, zombie.pid, "alpha")):
            (beats / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "pid": pid, "roles": roles}))
        pids = json.dumps({"0": dead.pid, "1": zombie.pid})
        helper = [sys.executable, "-m", "rlinf_hpc.runtime.deathwatch", str(tmp_path), "r1", pids]
        watch = subprocess.run(helper, capture_output=True, text=True, timeout=30)
    finally:
        zombie.wait()
    assert "in the same instant: rank 1 (alpha, pid" in watch.stderr, watch.stderr
    culprit = json.loads((tmp_path / "summary.json").read_text())["culprit"]
    assert culprit["seen_first"] == [0, 1], culprit


def test_the_death_watch_names_a_crashed_rank_whose_exit_it_has_not_seen_yet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A crash file is written before the crashed rank exits; the launcher (or MPI) may end the
    coordinator first. In CI the coordinator was then named alone for rank 1's segfault: the
    crashed rank is the culprit, with its crash, whatever exit the watch saw first."""
    from rlinf_hpc.runtime.deathwatch import _report

    beats = tmp_path / "heartbeats"
    beats.mkdir()
    (tmp_path / "summary.json").write_text(json.dumps({"run_id": "r1", "outcome": "running"}))
    for rank, roles in ((0, None), (1, "alpha"), (2, "beta")):
        record = {"rank": rank, "pid": 100 + rank, "roles": roles, "activity": "coordinating"}
        (beats / f"rank-{rank}.json").write_text(json.dumps(record))
    pids = {0: 100, 1: 101, 2: 102}
    _report(tmp_path, "r1", [0], pids, [0])  # no crash file: the coordinator it saw exit
    assert "rank 0 (coordinator)" in capsys.readouterr().err
    accounting.clear(tmp_path)  # each case below is a run of its own
    (tmp_path / "summary.json").write_text(json.dumps({"run_id": "r1", "outcome": "running"}))
    crash = "Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n"
    (beats / "rank-1.crash").write_text(crash + '  File "w.py", line 64 in segfault\n')
    (beats / "rank-2.crash").write_text("")  # opened at the start, as every rank's is: no crash
    _report(tmp_path, "r1", [0], pids, [0])
    said = capsys.readouterr().err
    assert said.startswith("rlinf-hpc: rank 1 (alpha) on") and "Segmentation fault, in segfault" in said
    culprit = json.loads((tmp_path / "summary.json").read_text())["culprit"]
    assert (culprit["rank"], culprit["cause"], culprit["seen_first"]) == (1, "crash", [0]), culprit
    # a crash after the first exit the watch saw may be that exit's consequence: not a candidate
    accounting.clear(tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps({"run_id": "r1", "outcome": "running"}))
    _report(tmp_path, "r1", [0], pids, [0], (beats / "rank-1.crash").stat().st_mtime - 1.0)
    assert capsys.readouterr().err.startswith("rlinf-hpc: rank 0 (coordinator)")


def test_mpich_segment_names_are_removed_once_attached_and_nothing_else() -> None:
    """The names of MPICH segments this process maps go; an unlinked one, a file MPICH did not
    name (a dataset copied to /dev/shm) and the memory itself stay."""
    import mmap

    from rlinf_hpc.comm.mpi import mapped_segments, unlink_attached_segments

    segment = Path(f"/dev/shm/mpich_shm_rlinftest{os.getpid()}_0")
    other = Path(f"/dev/shm/rlinftest_dataset_{os.getpid()}")
    try:
        for path in (segment, other):
            path.write_bytes(b"\1" * 4096)
        with segment.open("r+b") as f, mmap.mmap(f.fileno(), 4096) as shared, other.open("rb") as g, \
                mmap.mmap(g.fileno(), 4096, prot=mmap.PROT_READ) as data:  # fmt: skip
            maps = Path("/proc/self/maps").read_text()
            assert mapped_segments(maps) and str(segment) in mapped_segments(maps)
            assert str(segment) in unlink_attached_segments()
            assert not segment.exists() and other.exists() and shared[0] == 1 and data[0] == 1
            assert str(segment) not in mapped_segments(Path("/proc/self/maps").read_text())  # (deleted)
            assert unlink_attached_segments(maps) == []  # already gone: nothing to do, no error
    finally:
        for path in (segment, other):
            path.unlink(missing_ok=True)


def test_a_failure_mpi_raised_waits_a_moment_for_the_death_it_came_from() -> None:
    """`_dead_rank_first`: a send to a killed rank fails (over OFI) a moment before the rank's
    exit shows, and a peer's call that failed on its link is a plain error: every failure waits
    up to DEATH_GRACE_S for a death (a hetjob's killed rank was named "failed" after a peer's
    error, in CI under load)."""
    from rlinf_hpc.errors import WorkerError
    from rlinf_hpc.runners import job

    class Watch:
        def __init__(self, dies_after: int) -> None:
            self.looks, self.dies_after = 0, dies_after

        def fail_if_dead(self, then: str) -> None:
            self.looks += 1
            if self.looks > self.dies_after:
                raise SystemExit(f"named: {then}")  # the real one aborts the job from here

    mpi_error = WorkerError(2, "env", "rollout", "Exception: Other MPI error",
                            "Traceback ...\nmpi4py.MPI.Exception: Other MPI error\n")  # fmt: skip
    with pytest.raises(SystemExit, match="named: then rank 2"):
        job._dead_rank_first(Watch(dies_after=5), mpi_error, "then rank 2 (env) failed")
    plain = WorkerError(2, "env", "rollout", "ValueError: bad", "Traceback ...\nValueError: bad\n")
    with pytest.raises(SystemExit, match="named: then rank 2"):
        job._dead_rank_first(Watch(dies_after=5), plain, "then rank 2 (env) failed")
    started = time.monotonic()
    never = Watch(dies_after=10**6)
    job._dead_rank_first(never, mpi_error, "then rank 2 (env) failed")
    assert job.DEATH_GRACE_S <= time.monotonic() - started < job.DEATH_GRACE_S + 0.5
    job._dead_rank_first(None, mpi_error, "no watchdog")  # watchdog off: nothing to ask


def test_heartbeats_a_full_disk_stops_are_not_a_stopped_rank(tmp_path: Path) -> None:
    """On a full run directory every heartbeat goes stale: the watchdog says the disk is full
    (a ``disk_full`` record), not that the ranks stopped; their silence counts again from the
    moment the disk takes writes."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.decode().strip()})")
    try:
        (mount / "heartbeats").mkdir()
        then = time.time() - 30.0
        record = {"rank": 1, "pid": os.getpid(), "host": os.uname().nodename, "time": then,
                  "roles": "actor", "activity": "actor.update", "since": then}  # fmt: skip
        (mount / "heartbeats" / "rank-1.json").write_text(json.dumps(record))
        filler = mount / "filler"
        with contextlib.suppress(OSError), filler.open("wb") as out:
            while True:
                out.write(b"\0" * 4096)
        watch = Watchdog(
            mount, 2, hang_timeout_s=5.0, interval=60.0, action="abort", on_fatal=lambda m, c: None
        )
        try:
            assert watch.check() == []  # the disk is full: no stopped rank
            assert mount / "heartbeats" in disk.watch().failing
            filler.unlink()  # room again: the silence counts from the last refusal, not the beat
            assert watch.check() == []
            assert mount / "heartbeats" not in disk.watch().failing
            later = time.time() + 6.0
            assert [p["kind"] for p in watch.check(now=later)] == ["stopped"]
        finally:
            watch.close()
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_rank_the_death_watch_saw_exit_is_dead_before_its_pid_is_gone(tmp_path: Path) -> None:
    """A killed rank still tearing down answers to its pid; the death watch's record of its exit
    (``exits.jsonl``, written at the exit) makes it dead for the watchdog at once."""
    beats = tmp_path / "heartbeats"
    beats.mkdir()
    record = {"rank": 2, "pid": os.getpid(), "host": os.uname().nodename, "time": time.time(),
              "roles": "beta", "activity": "beta.sleep", "since": time.time()}  # fmt: skip
    (beats / "rank-2.json").write_text(json.dumps(record))
    watch = Watchdog(
        tmp_path, 3, hang_timeout_s=60.0, interval=60.0, action="abort", on_fatal=lambda m, c: None
    )
    try:
        assert watch.check() == []
        (beats / "exits.jsonl").write_text(json.dumps({"time": time.time(), "ranks": [2]}) + "\n")
        assert [(p["rank"], p["kind"]) for p in watch.check()] == [(2, "died")]
    finally:
        watch.close()
