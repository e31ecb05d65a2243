"""Run directories and job inputs are checked before any rank works: bad directories, a
directory another live job holds, summaries never left from an earlier run, run ids on every
event, a default directory when none is given; bad data and model files named up front."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import (
    BIN,
    CONFIGS,
    TINY,
    make_tiny_hf_model,
    mpiexec,
    probe_toml,
    rlinf,
    run_command,
    start_job,
    wait_for_pids,
)

pytestmark = pytest.mark.mpi


def _refused(result: object, *needles: str) -> None:
    assert result.returncode == 2, result.output  # type: ignore[attr-defined]
    for needle in needles:
        assert needle in result.output, result.output  # type: ignore[attr-defined]
    assert "Traceback" not in result.output  # type: ignore[attr-defined]


def test_bad_run_dirs_are_refused_before_any_rank_starts(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    _refused(
        rlinf("run", str(CONFIGS / "hello.toml"), "--run-dir", str(a_file)), "is a file, not a directory"
    )
    _refused(
        rlinf("run", str(CONFIGS / "hello.toml"), "--run-dir", str(a_file / "run")),
        f"lies under '{a_file}', which is a file",
    )
    # started in place by mpiexec (as srun would): rank 0 refuses and every rank ends
    _refused(
        mpiexec(3, "run", str(CONFIGS / "hello.toml"), "--run-dir", str(a_file), timeout=60), "is a file"
    )
    assert a_file.read_text() == "not a directory"  # nothing lost


def test_read_only_run_dir_is_refused(tmp_path: Path) -> None:
    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)]).returncode:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        _refused(
            rlinf("run", str(CONFIGS / "hello.toml"), "--run-dir", str(mount / "x")), "cannot be written"
        )
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_full_run_dir_is_refused_with_its_free_space(tmp_path: Path) -> None:
    """A directory can be created on a full disk (an empty file needs no block), but nothing
    written there: refused at the start, once, exit 2 (rank 0 died in its lock's write, and the
    other ranks waited in the start-up broadcast until MPI_Finalize's bound)."""
    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)]).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        with contextlib.suppress(OSError), (mount / "filler").open("wb") as out:
            while True:
                out.write(b"\0" * 4096)
        result = rlinf("run", str(CONFIGS / "hello.toml"), "--run-dir", str(mount / "run"))
        _refused(result, "takes no more writes (No space left on device; 0.0 MB free)", "Free space there")
        assert result.output.count("rlinf-hpc: error:") == 1, result.output
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_default_run_dir_and_run_ids(tmp_path: Path) -> None:
    result = run_command([str(BIN / "rlinf-hpc"), "run", str(CONFIGS / "hello.toml")], cwd=tmp_path)
    assert result.returncode == 0, result.output
    (run,) = (tmp_path / "runs").glob("hello-*")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outcome"] == "ok" and summary["run_id"]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert events and all(e["run_id"] == summary["run_id"] for e in events)
    assert events[-1]["event"] == "end" and events[-1]["outcome"] == "ok"
    assert not (run / "RUN.lock").exists()  # released at the end


def test_a_live_jobs_run_dir_is_refused_and_an_interrupted_summary_is_not_stale(tmp_path: Path) -> None:
    run_dir = tmp_path / "shared"
    first = rlinf("run", str(CONFIGS / "hello.toml"), "--run-dir", str(run_dir))
    assert first.returncode == 0, first.output
    ok_run = json.loads((run_dir / "summary.json").read_text())["run_id"]
    proc = start_job(
        [str(BIN / "rlinf-hpc"), "run", str(probe_toml(tmp_path, "signal_flow")), "--run-dir", str(run_dir)]
    )
    try:
        pids, _ = wait_for_pids(proc)
        running = json.loads((run_dir / "summary.json").read_text())
        assert running["outcome"] == "running" and running["run_id"] != ok_run
        second = rlinf("run", str(CONFIGS / "hello.toml"), "--run-dir", str(run_dir))
        _refused(second, "belongs to another running job", f"pid {pids[0]}", str(run_dir / "RUN.lock"))
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (
        summary["outcome"] == "SIGTERM" and summary["interrupted"] and summary["run_id"] == running["run_id"]
    )
    ends = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["outcome"] for e in ends if e["event"] == "end"] == ["ok", "SIGTERM"]
    again = rlinf("run", str(CONFIGS / "hello.toml"), "--run-dir", str(run_dir))
    assert again.returncode == 0, again.output  # the lock went with the job


def test_failed_run_names_the_culprit_in_summary_and_events(tmp_path: Path) -> None:
    result = rlinf("run", str(probe_toml(tmp_path, "failing_flow")), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 1, result.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["outcome"] == "failed" and summary["interrupted"]
    assert summary["culprit"]["component"] == "beta" and "boom from the test" in summary["culprit"]["error"]
    end = json.loads((tmp_path / "run" / "events.jsonl").read_text().splitlines()[-1])
    assert end["event"] == "end" and end["culprit"]["rank"] == summary["culprit"]["rank"]


def _math(tmp_path: Path, *sets: str, np: int | None = None) -> object:
    args = ["run", str(CONFIGS / "math_grpo_tiny.toml"), "--run-dir", str(tmp_path / "run")]
    args += ["--np", str(np)] if np else []
    for item in [*TINY, *sets]:
        args += ["--set", item]
    return rlinf(*args, timeout=300)


def test_bad_data_and_model_files_are_named_up_front(tmp_path: Path) -> None:
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(
        b'{"question": "1+1", "answer": "#### 2"}\n{"question": "caf\xe9", "answer": "#### 3"}\n'
    )
    _refused(
        _math(tmp_path, "task.kind=jsonl", f"task.train_path={latin}", f"task.eval_path={latin}"),
        f"{latin}:2: not UTF-8",
    )
    model = make_tiny_hf_model(tmp_path / "model")
    for weights in model.glob("*.safetensors"):
        weights.unlink()
    _refused(_math(tmp_path, f"model.path={model}"), "has a config.json but no weights")


def test_unwritable_warm_start_cache_is_a_warning_not_a_failure(tmp_path: Path) -> None:
    blocker = tmp_path / "cache-file"
    blocker.write_text("a file where the cache directory should be")
    # every component on one worker rank (2 ranks start in a third of the CPU time of 5): the
    # warm start and its cache are the same in every placement
    result = _math(tmp_path, "sft.cache_dir=" + str(blocker / "sft"), "placement.mode=collocated", np=2)
    assert result.returncode == 0, result.output  # type: ignore[attr-defined]
    assert "cannot be written" in result.output and "trained but not cached" in result.output  # type: ignore[attr-defined]
    assert "could not write the warm-start cache" in result.output  # type: ignore[attr-defined]
