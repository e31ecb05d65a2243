"""The fault matrix: every fault class on a worker and on rank 0, under each launcher and
placement, is named once — the same rank, component, host and cause on the console, in the
``end`` event, in ``rank_died`` (a death) and in ``summary.json`` — and nothing later replaces it.

Faults: kill -9, SIGTERM (to one rank), SIGSTOP, a crash below Python (SIGSEGV), a Python
exception. The OOM killer's row is `test_watchdog`'s (it needs a memory cgroup of its own).
Launchers: the bundled mpiexec, sbatch (srun in the batch script), srun in a salloc allocation.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import BIN, REPO, job_env, run_command, survivors

FAST = "[watchdog]\nheartbeat_s = 1.0\nhang_timeout_s = 6.0\n"

#: The cause each fault is to be named with.
CAUSES = {"kill": "died", "term": "signal", "stop": "stopped", "segv": "crash", "raise": "exception"}


@dataclass(frozen=True)
class Row:
    fault: str
    victim: int
    launcher: str = "mpiexec"  # mpiexec | sbatch | salloc
    placement: str = "disaggregated"

    def __str__(self) -> str:
        return f"{self.fault}-rank{self.victim}-{self.launcher}-{self.placement}"


ROWS = [
    *(Row(fault, victim) for fault in ("kill", "term", "segv", "raise") for victim in (2, 0)),
    Row("term", 1),  # a rank busy in a call: it cannot acknowledge the shutdown (an abort follows)
    Row("stop", 2),
    *(Row(fault, 1, placement="collocated") for fault in ("kill", "term", "raise")),
]
SLURM_ROWS = [
    *(Row(fault, 2, "sbatch") for fault in ("term", "segv", "raise")),
    Row("term", 0, "sbatch"),
    Row("term", 2, "salloc"),
]


def _config(tmp_path: Path, placement: str) -> Path:
    beta_ranks = 2 if placement == "collocated" else 1
    path = tmp_path / "job.toml"
    path.write_text(
        f'[job]\nname = "matrix"\nnum_ranks = 3\ncall_timeout_s = 60\n{FAST}'
        f'[placement]\nmode = "{placement}"\n'
        f'[components.alpha]\nworker = "job_workers:ProbeWorker"\nnum_ranks = {beta_ranks}\n'
        f'[components.beta]\nworker = "job_workers:ProbeWorker"\nnum_ranks = {beta_ranks}\n'
        '[flow]\nrunner = "job_workers:fault_flow"\n'
    )
    return path


def _start(row: Row, tmp_path: Path) -> tuple[subprocess.Popen[str] | str, Path, Path]:
    """The job started: (its process, or its SLURM job id; its output file; its run dir)."""
    config, run_dir, out = _config(tmp_path, row.placement), tmp_path / "run", tmp_path / "job.out"
    env = job_env(
        {"MPIEXEC_TIMEOUT": "90", "PROBE_FAULT": f"raise:{row.victim}" if row.fault == "raise" else ""}
    )
    run = ["run", str(config), "--run-dir", str(run_dir)]
    if row.launcher == "mpiexec":
        handle = out.open("w")
        proc = subprocess.Popen([str(BIN / "rlinf-hpc"), *run], stdout=handle, stderr=subprocess.STDOUT,
                                text=True, env=env, start_new_session=True)  # fmt: skip
        return proc, out, run_dir
    if row.launcher == "sbatch":
        args = [str(REPO / "slurm/single_node.sbatch"), *run[1:]]
    else:  # srun in an allocation, as one types it after salloc
        args = ["--wrap", f"srun --mpi=pmi2 --kill-on-bad-exit=1 {BIN / 'rlinf-hpc'} {' '.join(run)}"]
    submit = run_command(["sbatch", "--parsable", "-n", "3", f"--output={out}", f"--chdir={tmp_path}", *args],
                         timeout=30, env=env)  # fmt: skip
    assert submit.returncode == 0, submit.output
    return submit.stdout.strip().split(";")[0], out, run_dir


def _pids(out: Path) -> list[int]:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        text = out.read_text() if out.exists() else ""
        if "PIDS " in text:
            return [int(p) for p in text.split("PIDS ", 1)[1].splitlines()[0].split()]
        time.sleep(0.1)
    pytest.fail("the job never printed its PIDS line:\n" + (out.read_text() if out.exists() else ""))


def _wait(job: subprocess.Popen[str] | str, within: float) -> int | None:
    """The job's exit code (None under SLURM: its state is not the point here)."""
    deadline = time.monotonic() + within
    if isinstance(job, subprocess.Popen):
        try:
            return job.wait(timeout=within)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            pytest.fail(f"the job did not end within {within} s")
    while time.monotonic() < deadline:
        if job not in run_command(["squeue", "-h", "-j", job], timeout=30).stdout:
            return None
        time.sleep(0.3)
    run_command(["scancel", job], timeout=30)
    pytest.fail(f"SLURM job {job} did not end within {within} s")


def _check(row: Row, tmp_path: Path) -> None:
    job, out, run_dir = _start(row, tmp_path)
    try:
        pids = _pids(out)
        if row.fault != "raise":
            deadline = time.monotonic() + 30  # the death watch is on (it names a killed rank)
            while not (run_dir / "heartbeats" / "deathwatch.json").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.3)
            sig = {
                "kill": signal.SIGKILL,
                "term": signal.SIGTERM,
                "stop": signal.SIGSTOP,
                "segv": signal.SIGSEGV,
            }
            os.kill(pids[row.victim], sig[row.fault])
        code = _wait(job, 60)
    finally:
        for pid in set(pids) if "pids" in locals() else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    text = out.read_text()
    if code is not None:
        assert code == (143 if row.fault == "term" else code) and code != 0, (code, text)
    summary = json.loads((run_dir / "summary.json").read_text())
    culprit = summary["culprit"]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    ends = [e for e in events if e["event"] == "end"]
    died = [e for e in events if e["event"] == "rank_died"]
    # one account, written once: the end event and any rank_died carry the summary's culprit
    assert [e["culprit"] for e in ends] == [culprit], (events, summary, text)
    assert ends[0]["outcome"] == summary["outcome"], (ends, summary)
    assert [e["culprit"] for e in died] in ([], [culprit]), (died, summary)
    named = [culprit["rank"], *[c["rank"] for c in culprit.get("simultaneous", [])]]
    if row.fault == "kill" and culprit.get("seen_first") != [row.victim]:
        # exits seen in one wake-up cannot be ordered: the victim is among those named
        assert row.victim in named, (summary, text)
    else:
        assert culprit["rank"] == row.victim, (summary, text)
        assert culprit["cause"] == CAUSES[row.fault], (summary, text)
    assert culprit["host"] == socket.gethostname(), summary
    roles = json.loads((run_dir / "heartbeats" / f"rank-{culprit['rank']}.json").read_text())["roles"]
    component = culprit["component"]
    assert (
        component == "coordinator"
        if culprit["rank"] == 0
        else set(component.split("+")) <= set(roles.split("+"))
    )
    # the console names it; and a signal's rows print no traceback (none in a finaliser)
    assert (
        f"rank {culprit['rank']} ({component}" in text
        or f"rank {culprit['rank']} (component '{component}'" in text
    ), text
    if row.fault in ("term", "kill", "stop"):
        assert "Traceback" not in text and "Exception ignored" not in text, text
    assert summary.get("outcome") != "running" and summary["interrupted"] is True
    assert not survivors(pids, grace=10.0)


@pytest.mark.mpi
@pytest.mark.parametrize("row", ROWS, ids=str)
def test_every_fault_is_named_once_under_mpiexec(tmp_path: Path, row: Row) -> None:
    _check(row, tmp_path)


@pytest.mark.slurm
@pytest.mark.parametrize("row", SLURM_ROWS, ids=str)
def test_every_fault_is_named_once_under_slurm(tmp_path: Path, row: Row) -> None:
    from test_slurm import _REASON

    if _REASON:
        pytest.skip(_REASON)
    _check(row, tmp_path)


def test_the_first_claim_of_a_culprit_stands_across_processes(tmp_path: Path) -> None:
    """Eight processes name eight culprits at once: one wins, and every reader sees it."""
    script = (
        "import sys; from pathlib import Path; from rlinf_hpc.runtime import accounting as a; "
        "won, _, c = a.claim_culprit(Path(sys.argv[1]), 'r1', 'rank died', {'rank': int(sys.argv[2])}); "
        "print(int(won), c['rank'])"
    )
    procs = [
        subprocess.Popen(
            [str(BIN / "python"), "-c", script, str(tmp_path), str(r)], stdout=subprocess.PIPE, text=True
        )
        for r in range(8)
    ]
    answers = [p.communicate(timeout=60)[0].split() for p in procs]
    winners = [rank for won, rank in answers if won == "1"]
    assert len(winners) == 1 and {rank for _, rank in answers} == set(winners), answers
    from rlinf_hpc.runtime import accounting

    assert accounting.claimed_culprit(tmp_path, "r1") == ("rank died", {"rank": int(winners[0])})
    assert accounting.claimed_culprit(tmp_path, "another run") is None
    # a previous run's claim left in a reused directory does not hold for this run
    won, _, culprit = accounting.claim_culprit(tmp_path, "r2", "failed", {"rank": 9})
    assert won and culprit == {"rank": 9}
    assert accounting.claim_end(tmp_path, "r2", "coordinator") and not accounting.claim_end(
        tmp_path, "r2", "watchdog"
    )


def test_a_signal_landing_in_a_finaliser_is_delivered_again_without_a_traceback() -> None:
    """SIGTERM whose handler ran in a ``__del__`` (mpi4py's Group.__del__ under SLURM) printed
    "Exception ignored in ..." and was lost: the rank went on."""
    script = (
        "import gc, os, signal, time\n"
        "from rlinf_hpc.errors import JobInterrupted\n"
        "from rlinf_hpc.runtime.signals import install_signal_handlers\n"
        "install_signal_handlers()\n"
        "class Finaliser:\n"
        "    def __del__(self):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        for _ in range(1000): pass\n"
        "try:\n"
        "    Finaliser(); gc.collect()\n"
        "    for _ in range(100): time.sleep(0.01)\n"
        "    print('LOST')\n"
        "except JobInterrupted as exc:\n"
        "    print('INTERRUPTED', exc.signal_name)\n"
    )
    done = subprocess.run([str(BIN / "python"), "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "INTERRUPTED SIGTERM", done.stdout + done.stderr
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.mpi
def test_a_killed_death_watch_is_started_again_and_still_names_a_killed_rank(tmp_path: Path) -> None:
    """With its helper killed the job ran to exit 0, and a rank killed later would not have been
    named by it: rank 0 starts it again, says so, and the new one names the next death."""
    job, out, run_dir = _start(Row("kill", 2), tmp_path)
    assert isinstance(job, subprocess.Popen)
    pids = _pids(out)
    ready = run_dir / "heartbeats" / "deathwatch.json"
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    first = json.loads(ready.read_text())["pid"]
    os.kill(first, signal.SIGKILL)
    while time.monotonic() < deadline + 30:
        with contextlib.suppress(OSError, ValueError):
            if json.loads(ready.read_text())["pid"] != first:
                break
        time.sleep(0.1)
    else:
        job.kill()
        pytest.fail("the death watch was not started again:\n" + out.read_text())
    os.kill(pids[2], signal.SIGKILL)
    assert _wait(job, 60) != 0
    text = out.read_text()
    assert f"the death watch (pid {first}) ended with code -9: started again" in text, text
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["pid"] for e in events if e["event"] == "deathwatch_restarted"] == [first]
    died = [e["culprit"] for e in events if e["event"] == "rank_died"]
    assert died and 2 in [died[0]["rank"], *[c["rank"] for c in died[0].get("simultaneous", [])]], events
    assert not survivors(pids, grace=10.0)
