"""Whole jobs under the bundled mpiexec: placement, calls, failures, signals, re-partition.

Every job runs with a timeout (ours and Hydra's MPIEXEC_TIMEOUT): a hang fails the test.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import BIN, CONFIGS, Completed, mpiexec, probe_toml, rlinf, start_job, survivors, wait_for_pids

pytestmark = pytest.mark.mpi


def _line(output: str, prefix: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, output
    return lines[0][len(prefix) :]


def test_hello_launches_four_ranks_and_prints_results(tmp_path: Path) -> None:
    result = rlinf("run", str(CONFIGS / "hello.toml"), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.output
    assert "placement: 4 ranks" in result.stdout
    assert "(coordinator)" in result.stdout
    assert "1->1, 2->4, 3->9, 4->16, 5->25, 6->36, 7->49, 8->64" in result.stdout  # squarer
    assert "1->2, 3->6, 5->10, 7->14" in result.stdout  # doubler rank 1 of 2
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["outcome"] == "ok"
    assert summary["flow_result"]["doubler"]["outputs"] == [2 * x for x in range(1, 9)]
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert events[0]["event"] == "placement" and events[-1]["outcome"] == "ok"
    assert (tmp_path / "run" / "config.toml").exists()
    # the timeline has every worker's calls; `rlinf-hpc trace` turns it into Perfetto + PNG
    spans = [json.loads(x) for x in (tmp_path / "run" / "timeline.jsonl").read_text().splitlines()]
    calls = {(s["rank"], s["name"]) for s in spans if s["cat"] == "call"}
    assert calls == {(1, "doubler.apply"), (2, "doubler.apply"), (3, "squarer.apply")}
    assert {s["name"] for s in spans if s["rank"] == 0} >= {"placement", "flow"}
    traced = rlinf("trace", str(tmp_path / "run"))
    assert traced.returncode == 0, traced.output
    trace = json.loads((tmp_path / "run" / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1, 2, 3}
    assert (tmp_path / "run" / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_in_place_under_mpiexec_groups_have_working_communicators(tmp_path: Path, num_ranks: int) -> None:
    path = tmp_path / "one.toml"
    path.write_text(
        f'[components.alpha]\nworker = "job_workers:ProbeWorker"\nnum_ranks = {num_ranks - 1}\n'
        '[flow]\nrunner = "job_workers:check_flow"\n'
    )
    result = mpiexec(num_ranks, "run", str(path))
    assert result.returncode == 0, result.output
    assert "starting" not in result.stderr  # ran in place, no self-launch
    checks = ast.literal_eval(_line(result.stdout, "CHECK "))["alpha"]
    workers = list(range(1, num_ranks))
    assert [c["rank"] for c in checks] == workers
    assert all(c["ranks"] == workers and c["rank_sum"] == sum(workers) for c in checks)


def test_worker_exception_ends_job_with_one_message(tmp_path: Path) -> None:
    start = time.monotonic()
    result = rlinf("run", str(probe_toml(tmp_path, "failing_flow")), timeout=60)
    assert result.returncode == 1, result.output
    assert time.monotonic() - start < 30
    message = "rank 2 (component 'beta') failed in fail: ValueError: boom from the test"
    assert result.stderr.count(message) == 1, result.stderr
    assert 'job_workers.py", line' in result.stderr  # the worker's own traceback comes back
    assert "service.py" not in result.stderr  # without our plumbing frames


def test_hung_worker_call_times_out_naming_rank_and_method(tmp_path: Path) -> None:
    start = time.monotonic()
    result = rlinf(
        "run", str(probe_toml(tmp_path, "hanging_flow")), "--set", "job.call_timeout_s=2", timeout=60
    )
    assert result.returncode != 0
    assert time.monotonic() - start < 45  # start-up included: ~25 s on a slow, busy 2-core box
    assert "waited for rank 1 (component 'alpha') to finish sleep" in result.stderr, result.stderr
    assert "no answer after 2.0 s" in result.stderr


def test_worker_setup_error_names_rank_component(tmp_path: Path) -> None:
    result = rlinf(
        "run", str(CONFIGS / "hello.toml"), "--set", "components.squarer.options.operation=cube", timeout=60
    )
    assert result.returncode == 1, result.output
    assert "rank 3 (component 'squarer') failed in setup" in result.stderr
    assert "operation 'cube' is not one of" in result.stderr


def test_missing_worker_class_is_a_user_error(tmp_path: Path) -> None:
    result = rlinf(
        "run", str(CONFIGS / "hello.toml"), "--set", "components.squarer.worker=job_workers:Nope", timeout=60
    )
    assert result.returncode == 2, result.output
    assert "'Nope' in module 'job_workers' is missing" in result.stderr
    assert "Traceback" not in result.output


def test_a_pipelines_auto_with_shared_groups_is_a_user_error() -> None:
    """auto with placement.groups is for flows that place themselves (embodied PPO); a
    Pipeline's auto measures a collocated warm-up, so it refuses the groups, naming them."""
    groups = 'placement.groups=[["producer", "transformer"]]'
    result = rlinf("run", str(CONFIGS / "toy_pipeline.toml"), "--set", "placement.mode=auto", "--set", groups)
    assert result.returncode == 2, result.output
    assert "asks for a warm-up with shared groups" in result.stderr and "Traceback" not in result.output


def test_bad_config_in_place_prints_once_and_all_ranks_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[components.a]\nworker = "job_workers:ProbeWorker"\nnum_rank = 1\n')
    result = mpiexec(3, "run", str(path))
    assert result.returncode == 2, result.output
    assert result.stderr.count("rlinf-hpc: error:") == 1, result.stderr
    assert "Did you mean `num_ranks`?" in result.stderr


def test_one_rank_in_place_is_a_user_error() -> None:
    result = mpiexec(1, "run", str(CONFIGS / "hello.toml"))
    assert result.returncode == 2, result.output
    assert "single rank" in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_ends_every_rank_cleanly(tmp_path: Path, signum: int, code: int) -> None:
    proc = start_job([str(BIN / "rlinf-hpc"), "run", str(probe_toml(tmp_path, "signal_flow"))])
    pids, lines = wait_for_pids(proc)
    assert len(pids) == 3
    proc.send_signal(signum)  # rlinf-hpc exec'd mpiexec, which forwards it to every rank
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("job did not end within 30 s of the signal")
    assert proc.returncode == code, "".join(lines) + out
    assert not survivors(pids, grace=15.0), out
    assert "Traceback" not in out
    assert f"received {signal.Signals(signum).name}: stopping every rank" in out


def test_signal_to_coordinator_alone_still_ends_job(tmp_path: Path) -> None:
    proc = start_job([str(BIN / "rlinf-hpc"), "run", str(probe_toml(tmp_path, "signal_flow"))])
    pids, lines = wait_for_pids(proc)
    os.kill(pids[0], signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("job did not end within 30 s of signalling rank 0")
    out = "".join(lines) + out
    assert proc.returncode != 0, out
    assert not survivors(pids, grace=15.0), out
    # rank 1 is busy in a 120 s call, so it cannot say goodbye: rank 0 names it and aborts.
    assert "rank 1 busy in alpha.sleep" in out, out


def test_repartition_moves_a_rank_and_frees_old_communicators(tmp_path: Path) -> None:
    result = rlinf("run", str(probe_toml(tmp_path, "repartition_flow", alpha=1, beta=3)))
    assert result.returncode == 0, result.output
    report = ast.literal_eval(_line(result.stdout, "REPARTITION "))
    assert report["placement"] == {"alpha": [1, 4], "beta": [2, 3]}
    assert report["before"]["beta"][0]["ranks"] == [2, 3, 4]
    after = report["after"]
    assert [c["ranks"] for c in after["alpha"]] == [[1, 4], [1, 4]]
    assert [c["rank_sum"] for c in after["beta"]] == [5, 5]
    # each rank holds exactly one live group communicator: the old ones were freed
    assert all(c["live_group_comms"] == 1 for group in after.values() for c in group)
    by_rank = {e["rank"]: e for e in report["echoes"]}
    assert by_rank[1]["calls"] == 2  # stayed in alpha: state kept
    assert by_rank[4]["calls"] == 1 and by_rank[4]["marker"] == "A"  # joined: fresh worker


def test_idle_four_rank_job_uses_under_ten_percent_cpu(tmp_path: Path) -> None:
    result = rlinf("run", str(probe_toml(tmp_path, "idle_flow", alpha=1, beta=2)))
    assert result.returncode == 0, result.output
    fraction = float(_line(result.stdout, "IDLE_CPU_FRACTION "))
    assert fraction < 0.10, f"idle job used {fraction:.1%} of a core in total"


def test_info_describes_every_rank() -> None:
    result = rlinf("info", "--np", "2")
    assert result.returncode == 0, result.output
    assert "MPICH" in result.stdout and "ranks: 2 on 1 node(s)" in result.stdout
    assert "mpiexec (Hydra/PMI) with 2 ranks" in result.stdout


def test_workers_talk_by_address_and_after_repartition(tmp_path: Path) -> None:
    config = probe_toml(tmp_path, "peer_flow", alpha=1, beta=3).read_text()
    config = config.replace("job_workers:ProbeWorker", "job_workers:PeerWorker")
    path = tmp_path / "peer.toml"
    path.write_text(config)
    result = rlinf("run", str(path))
    assert result.returncode == 0, result.output
    report = ast.literal_eval(_line(result.stdout, "PEER "))
    assert report["first"] == {"from": 1, "payload": [[0, 1, 2], [3, 4, 5]]}
    assert report["sums"] == [3, 3, 3]  # gather + broadcast over the 3 beta ranks
    assert report["second"] == {"from": report["moved"], "payload": "hello from a new member"}
    assert report["alpha"] == [1, report["moved"]]
    assert "no component 'coordinator-check'" in report["gone"]


def test_channel_items_survive_a_consumer_leaving(tmp_path: Path) -> None:
    path = tmp_path / "channel.toml"
    path.write_text(
        '[job]\nname = "channel"\nnum_ranks = 6\ncall_timeout_s = 120\n'
        '[components.producer]\nworker = "job_workers:ChannelWorker"\n'
        '[components.consumer]\nworker = "job_workers:ChannelWorker"\nnum_ranks = 3\n'
        '[components.spare]\nworker = "job_workers:ChannelWorker"\n'
        '[channels.work]\nproducers = "producer"\nconsumers = "consumer"\ncapacity = 1000\n'
        'policy = "shortest_queue"\n'
        '[flow]\nrunner = "job_workers:channel_flow"\n'
    )
    result = rlinf("run", str(path), "--run-dir", str(tmp_path / "run"), timeout=180)
    assert result.returncode == 0, result.output
    report = ast.literal_eval(_line(result.stdout, "CHANNEL "))
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    recorded = [e for e in events if e["event"] == "channel_stats"]
    assert recorded[0]["channel"] == "work" and recorded[0]["outstanding"] == 0  # by the flow
    automatic = recorded[-1]  # written by the runtime when the flow returned
    assert automatic["channel"] == "work" and len(automatic["ranks"]) == 3  # producer + 2 consumers
    # the two remaining consumers took all 300 items but the 20 the leaving one took before it left
    assert sum(r["served_items"] for r in automatic["ranks"]) == 280
    # 300 items, each consumed exactly once, although a consumer left holding some of them
    assert (report["count"], report["unique"], report["min"], report["max"]) == (300, 300, 0, 299)
    assert report["forwarded"] > 0, report  # the leaving consumer really held items to hand over
    assert report["producer"]["outstanding"] == 0  # every item acknowledged to its producer


def _channel_job(tmp_path: Path, flow: str, consumers: int = 2, extra: str = "") -> Completed:
    """Run ``flow`` from tests/job_workers.py over a ChannelWorker producer (1 rank) and
    consumer (``consumers`` ranks); ``extra``: more config text."""
    path = tmp_path / "channels.toml"
    path.write_text(
        f'[job]\nname = "channels"\nnum_ranks = {2 + consumers}\ncall_timeout_s = 120\n'
        '[components.producer]\nworker = "job_workers:ChannelWorker"\n'
        f'[components.consumer]\nworker = "job_workers:ChannelWorker"\nnum_ranks = {consumers}\n'
        f'{extra}[flow]\nrunner = "job_workers:{flow}"\n'
    )
    return rlinf("run", str(path), timeout=120)


def test_flow_declares_a_channel_at_run_time(tmp_path: Path) -> None:
    result = _channel_job(tmp_path, "late_channel_flow")
    assert result.returncode == 0, result.output
    report = ast.literal_eval(_line(result.stdout, "LATE "))
    assert report["taken"] == list(range(40))
    assert len(report["errors"]) == 2 and "names ['nobody']" in report["errors"][0]
    assert "`channels.bad.capacity`" in report["errors"][1]


def test_pipeline_items_reaching_a_rank_before_its_stream_declaration_are_kept(tmp_path: Path) -> None:
    """A step's streams are declared without waiting for the ranks; a consumer rank busy with
    an earlier command gets the producer's items before it knows the stream: none is lost."""
    result = _channel_job(tmp_path, "busy_consumer_flow", extra='[placement]\nmode = "disaggregated"\n')
    assert result.returncode == 0, result.output
    report = ast.literal_eval(_line(result.stdout, "BUSY "))
    assert report["outputs"] == [[4 * x for x in range(s * 50, (s + 1) * 50)] for s in range(3)]
    assert all(s >= 0.5 for s in report["seconds"]), report  # the step waited for the busy rank


def test_a_failed_update_nobody_waited_for_fails_the_job(tmp_path: Path) -> None:
    """A directory update sent without waiting fails on the ranks (items never taken): the
    job ends with exit 1 naming the error, never 0 because later calls succeeded."""
    result = _channel_job(tmp_path, "lost_in_background_flow", consumers=1)
    assert result.returncode == 1, result.output
    assert "set_directory" in result.output and "nobody consumed" in result.output, result.output


def test_worker_declares_a_channel_from_inside_a_method(tmp_path: Path) -> None:
    result = _channel_job(tmp_path, "worker_channel_flow")
    assert result.returncode == 0, result.output
    report = ast.literal_eval(_line(result.stdout, "DYN "))
    assert "channels.dyn.producers names ['nobody']" in report["bad"]
    assert report["made"] == 30 and report["taken"] == list(range(30))
    assert "channel 'dyn' exists already" in report["again"]


@pytest.mark.parametrize(
    ("mode", "num_ranks", "squarer_rank"),
    [("collocated", 3, "1"), ("disaggregated", 4, "3")],
)
def test_hello_gives_the_same_results_collocated_or_not(mode: str, num_ranks: int, squarer_rank: str) -> None:
    result = rlinf(
        "run", str(CONFIGS / "hello.toml"), "--np", str(num_ranks), "--set", f"placement.mode={mode}"
    )
    assert result.returncode == 0, result.output
    assert f"placement: {num_ranks} ranks" in result.stdout
    rows = [line for line in result.stdout.splitlines() if line.startswith("│ squarer")]
    assert rows[-1].split("│")[2].strip() == squarer_rank  # where the squarer ran
    assert "1->1, 2->4, 3->9, 4->16, 5->25, 6->36, 7->49, 8->64" in result.stdout


@pytest.mark.parametrize("offload", ["none", "byte_planes", "delta"])
def test_collocated_components_take_turns_on_the_device(tmp_path: Path, offload: str) -> None:
    path = tmp_path / "switch.toml"
    path.write_text(
        '[job]\nname = "switch"\nnum_ranks = 2\ncall_timeout_s = 120\n'
        f'[placement]\nmode = "collocated"\nswitch = "full"\noffload = "{offload}"\n'
        '[components.alpha]\nworker = "job_workers:ModelWorker"\n'
        '[components.beta]\nworker = "job_workers:ModelWorker"\n'
        '[flow]\nrunner = "job_workers:switch_flow"\n'
    )
    result = rlinf("run", str(path), "--run-dir", str(tmp_path / "run"), timeout=120)
    assert result.returncode == 0, result.output
    report = ast.literal_eval(_line(result.stdout, "SWITCH "))
    full = 64 * 64 + 64 + 64 + 1
    assert report["before"]["numel"] == {"alpha": full, "beta": 0}
    assert report["during_beta"]["numel"] == {"alpha": 0, "beta": full}  # alpha was switched out
    assert report["after"]["sha"] == report["before"]["sha"]  # and came back bit for bit
    spans = [json.loads(x) for x in (tmp_path / "run" / "timeline.jsonl").read_text().splitlines()]
    switches = [s for s in spans if s["cat"] == "switch"]
    assert [s["name"] for s in switches] == ["switch to alpha", "switch to beta", "switch to alpha"][
        -len(switches) :
    ]
    assert switches and all(s["args"]["bytes"] > 0 for s in switches)


def test_light_switch_only_releases_caches(tmp_path: Path) -> None:
    path = tmp_path / "light.toml"
    path.write_text(
        '[job]\nname = "light"\nnum_ranks = 2\ncall_timeout_s = 120\n'
        '[placement]\nmode = "collocated"\nswitch = "light"\n'
        '[components.alpha]\nworker = "job_workers:ModelWorker"\n'
        '[components.beta]\nworker = "job_workers:ModelWorker"\n'
        '[flow]\nrunner = "job_workers:switch_flow"\n'
    )
    result = rlinf("run", str(path), timeout=120)
    assert result.returncode == 0, result.output
    report = ast.literal_eval(_line(result.stdout, "SWITCH "))
    full = 64 * 64 + 64 + 64 + 1
    assert report["during_beta"]["numel"] == {"alpha": full, "beta": full}  # weights stay
    assert report["after"]["caches_released"] >= 1 and report["after"]["sha"] == report["before"]["sha"]
