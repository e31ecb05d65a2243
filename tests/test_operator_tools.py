"""The operator's tools on a live job (the toy pipeline, 50 steps): `profile` samples a
component's rank without stopping it (hot functions, communication share, bubbles, a Chrome
trace), `monitor` shows every rank and exits when the job ends, `trace --steps` zooms the
finished run's Gantt chart; and each refuses bad input with exit code 2."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import BIN, REPO, rlinf, start_job

pytestmark = pytest.mark.mpi


class LiveJob:
    def __init__(self, run_dir: Path, proc: subprocess.Popen[str]) -> None:
        self.run_dir, self.proc = run_dir, proc

    def wait_end(self) -> str:
        out, _ = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, out
        return out


@pytest.fixture(scope="module")
def live_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveJob]:
    run_dir = tmp_path_factory.mktemp("toy") / "run"
    proc = start_job([str(BIN / "rlinf-hpc"), "run", str(REPO / "configs" / "toy_pipeline.toml"), "--run-dir",
                      str(run_dir), "--set", "flow.options={steps=50, num_items=96}"])  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # every rank beats and the first steps ended
        events = run_dir / "events.jsonl"
        if events.exists() and events.read_text().count('"pipeline_step"') >= 2:
            break
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("the toy job did not start")
    yield LiveJob(run_dir, proc)
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def test_profile_samples_a_running_component(live_job: LiveJob, tmp_path: Path) -> None:
    out = rlinf("profile", str(live_job.run_dir), "--component", "transformer", "--duration", "3",
                "--out", str(tmp_path), timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "profile.json").read_text())
    ((rank, stats),) = report["ranks"].items()
    assert rank == "2" and stats["sampled_s"] > 2.0
    assert stats["hot"][0]["function"] == "ToyStage.process"  # it sleeps seconds_per_item per item
    assert 0.0 < stats["comm_share"] < 0.6
    stages = report["stages"]
    assert set(stages) == {"producer.process", "transformer.process", "consumer.process"}
    assert all(0.0 <= s["bubble"] <= 1.0 and s["steps"] >= 3 for s in stages.values())
    assert stages["consumer.process"]["bubble"] > stages["producer.process"]["bubble"]  # the last stage waits
    trace = json.loads((tmp_path / "profile_trace.json").read_text())["traceEvents"]
    assert {"name": "process_name", "ph": "M", "pid": 2, "args": {"name": "rank 2 (transformer)"}} in trace
    assert sum(e.get("ph") == "B" for e in trace) > 10
    assert "communication" in out.stdout and "bubble" in out.stdout


def test_monitor_shows_every_rank_then_follows_the_job_to_its_end(live_job: LiveJob) -> None:
    once = rlinf("monitor", str(live_job.run_dir), "--once", "--metric", "mem_usage,batch_size,gpu_util")
    assert once.returncode == 0, once.stderr
    for component in ("coordinator", "producer", "transformer", "consumer"):
        assert component in once.stdout
    assert "RSS MB" in once.stdout and "micro-batch" in once.stdout and "running" in once.stdout
    started = time.monotonic()
    follow = rlinf("monitor", str(live_job.run_dir), "--interval", "0.5", timeout=120)
    job_out = live_job.wait_end()
    assert follow.returncode == 0, follow.stderr
    assert "the job ended" in follow.stdout and ": ok" in follow.stdout
    assert follow.stdout.count("toy step") >= 3  # one frame per interval until the end
    assert time.monotonic() - started < 60, job_out


def test_trace_zooms_to_steps_of_the_finished_run(live_job: LiveJob) -> None:
    live_job.proc.poll() is None and live_job.wait_end()
    out = rlinf("trace", str(live_job.run_dir), "--steps", "10-12")
    assert out.returncode == 0, out.stderr
    trace = json.loads((live_job.run_dir / "trace-steps-10-12.json").read_text())["traceEvents"]
    steps = [e["name"] for e in trace if e.get("cat") == "step"]
    assert steps == ["step 10", "step 11", "step 12"]
    spans = [e for e in trace if e.get("ph") == "X"]
    assert max(e["ts"] + e["dur"] for e in spans) < 5e6  # three steps of ~0.45 s, not the run
    assert (live_job.run_dir / "timeline-steps-10-12.png").stat().st_size > 1000


def test_finished_runs_and_bad_input(live_job: LiveJob, tmp_path: Path) -> None:
    live_job.proc.poll() is None and live_job.wait_end()
    done = rlinf("monitor", str(live_job.run_dir))
    assert done.returncode == 0 and "outcome" in done.stdout and "ok" in done.stdout
    cases = [
        (["profile", str(live_job.run_dir), "--component", "transformer"], "is not running"),
        (["monitor", str(tmp_path / "nothing")], "does not exist"),
        (["monitor", str(tmp_path)], "is not a run directory"),
        (["monitor", str(live_job.run_dir), "--metric", "gpu_util,tokens"], "unknown tokens"),
        (["trace", str(live_job.run_dir), "--steps", "9-3"], "0 <= A <= B"),
        (["trace", str(live_job.run_dir), "--steps", "a-b"], "is not a step range"),
        (["trace", str(live_job.run_dir), "--steps", "500"], "its steps are 1-50"),
    ]
    for args, message in cases:
        out = rlinf(*args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert message in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)
