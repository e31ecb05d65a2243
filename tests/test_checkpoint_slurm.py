"""Checkpoint-restart through the real local SLURM cluster: `rlinf-hpc submit` a long job,
signal it the way ``--signal=B:USR2`` does before a time limit, watch it save, requeue itself,
resume and finish with the same final state as a run that was never interrupted."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
from test_checkpoint_jobs import _assert_same_state, _final, _metrics
from test_slurm import _REASON

from conftest import CONFIGS, TINY, job_env, rlinf, run_command

pytestmark = [pytest.mark.slurm, *([pytest.mark.skip(reason=_REASON)] if _REASON else [])]

SETS = [
    *[s for s in TINY if not s.startswith(("grpo.steps=", "flow.runner="))],
    "grpo.steps=30",  # signalled after 10: the rest (~10 s) outlasts the signal's way in by seconds
    "checkpoint.every_steps=10",  # periodic saves before the signal and after the resume
    # elastic micro-batches (the default): batch-invariant forwards keep the resume exact
    "flow.runner=math_grpo",
    # every component on one worker rank: 2 tasks start in a third of the CPU time of 5 (each
    # worker rank imports torch and transformers), and the save/requeue/resume path is the same
    "placement.mode=collocated",
]


def _job_field(job_id: str, name: str) -> str:
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, env=job_env(), timeout=20
    ).stdout
    match = re.search(rf"\b{name}=(\S+)", out)
    return match.group(1) if match else ""


def _wait_for(what: str, condition, timeout: float, job: tuple[str, Path] | None = None) -> None:
    """Poll ``condition``; on timeout, fail with the job's state and the end of its log when
    ``job`` = (job id, its log file) is given (a job that never started, or died in MPI_Init,
    reads very differently from one that is only slow)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    detail = ""
    if job is not None:
        job_id, log = job
        state = run_command(["scontrol", "show", "job", "-o", job_id], timeout=30).output.strip()
        queue = run_command(["squeue", "-h", "-o", "%i %T %R %j"], timeout=30).output.strip()
        tail = log.read_text()[-4000:] if log.exists() else f"(no {log})"
        detail = f"\njob: {state}\nqueue:\n{queue}\nlog tail:\n{tail}"
    raise AssertionError(f"timed out waiting for {what}{detail}")


def _start_now(job_id: str, pending_since: list[float]) -> bool:
    """SLURM holds a requeued job for ~2 minutes (BeginTime); as root the test lifts the hold
    once the job has been pending for 3 s (an update while it is still being requeued does
    nothing, and a relaunch in the second its credential was revoked is refused), which also
    checks that a restart soon after the requeue works."""
    state = _job_field(job_id, "JobState")
    if state == "PENDING":
        if not pending_since:
            pending_since.append(time.monotonic())
        elif time.monotonic() - pending_since[0] >= 3.0:
            run_command(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], timeout=30)
    return state in ("RUNNING", "COMPLETED")  # COMPLETING: still the requeued run's end


# Three job start-ups: ~1 minute alone, but the other pytest worker's many-rank jobs can starve
# them (a 5-rank start-up once took 138 s in CI), so the bound is the sum of the waits below.
@pytest.mark.timeout(900)
def test_signal_save_requeue_resume_ends_equal_to_an_uninterrupted_run(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    args = [item for s in SETS for item in ("--set", s)]
    config = str(CONFIGS / "math_grpo_tiny.toml")
    result = rlinf("run", config, "--np", "2", "--run-dir", str(reference), *args, timeout=240)
    assert result.returncode == 0, result.output

    run_dir = tmp_path / "long"
    submitted = rlinf("submit", config, "--run-dir", str(run_dir), "--time", "00:20:00", *args, timeout=60)
    assert submitted.returncode == 0, submitted.output
    job_id = re.search(r"submitted job (\d+)", submitted.stdout).group(1)  # type: ignore[union-attr]
    metrics = run_dir / "metrics.jsonl"
    job = (job_id, run_dir / f"slurm-{job_id}.out")
    try:
        ten = lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 10  # noqa: E731
        _wait_for("10 steps", ten, 150, job)
        signal = run_command(["scancel", "--batch", "--signal=USR2", job_id], timeout=30)
        assert signal.returncode == 0, signal.output
        _wait_for("the requeue", lambda: _job_field(job_id, "Restarts") == "1", 90, job)
        pending_since: list[float] = []
        _wait_for("the requeued job to start", lambda: _start_now(job_id, pending_since), 150, job)
        _wait_for("the job to finish", lambda: _job_field(job_id, "JobState") == "COMPLETED", 240, job)
    finally:
        run_command(["scancel", job_id], timeout=30)
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert "(signal SIGUSR2)" in log and f"requeueing SLURM job {job_id} (preemption" in log, log
    assert "restart 1" in log and "resumed from" in log and "job 'math-grpo-tiny' finished" in log, log
    _assert_same_state(_final(reference), _final(run_dir))
    assert _metrics(run_dir) == _metrics(reference)


@pytest.mark.timeout(600)
def test_scancel_with_a_sigterm_grace_saves_the_step_and_is_not_requeued(tmp_path: Path) -> None:
    """``checkpoint.sigterm_save_s``: a plain ``scancel`` (SIGTERM to every task, SIGKILL after
    KillWait) saves the step it landed in, the job ends cancelled and is not requeued, and the
    same command resumes from that step."""
    args = [item for s in [*SETS, "checkpoint.sigterm_save_s=20"] for item in ("--set", s)]
    config = str(CONFIGS / "math_grpo_tiny.toml")
    run_dir = tmp_path / "long"
    submitted = rlinf("submit", config, "--run-dir", str(run_dir), "--time", "00:20:00", *args, timeout=60)
    assert submitted.returncode == 0, submitted.output
    job_id = re.search(r"submitted job (\d+)", submitted.stdout).group(1)  # type: ignore[union-attr]
    metrics = run_dir / "metrics.jsonl"
    log = run_dir / f"slurm-{job_id}.out"
    try:
        five = lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 5  # noqa: E731
        _wait_for("5 steps", five, 150, (job_id, log))
        cancel = run_command(["scancel", job_id], timeout=30)
        assert cancel.returncode == 0, cancel.output
        _wait_for("the job to end", lambda: _job_field(job_id, "JobState") == "CANCELLED", 90, (job_id, log))
        _wait_for("its log", lambda: "and stopped (signal SIGTERM)" in log.read_text(), 30, (job_id, log))
    finally:
        run_command(["scancel", job_id], timeout=30)
    saved = re.search(r"saved step (\d+) and stopped \(signal SIGTERM\)", log.read_text())
    assert saved and (run_dir / "checkpoints" / f"step-{int(saved.group(1)):08d}").is_dir(), log.read_text()
    assert _job_field(job_id, "Restarts") == "0" and "requeueing" not in log.read_text()
    resumed = rlinf(
        "run", str(run_dir / "submitted.toml"), "--np", "2", "--run-dir", str(run_dir), timeout=240
    )
    assert resumed.returncode == 0, resumed.output
    assert f"(step {saved.group(1)}, saved for: signal SIGTERM)" in resumed.output, resumed.output
