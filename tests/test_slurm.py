"""Jobs on the real local SLURM cluster (bash slurm/local/up.sh; .ci/run starts it).

Skipped, with the reason, where no SLURM controller answers.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import CONFIGS, REPO, Completed, job_env, run_command, survivors

pytestmark = pytest.mark.slurm


def _slurm_reason() -> str | None:
    if shutil.which("sbatch") is None:
        return "sbatch not installed: run `bash slurm/local/up.sh` (installs slurm-wlm + munge)"
    try:
        probe = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10, env=job_env()
        )
    except subprocess.TimeoutExpired:
        return "sinfo timed out: no SLURM controller answers"
    if probe.returncode != 0 or not probe.stdout.strip():
        return (
            "no SLURM controller answers (start one with `bash slurm/local/up.sh` and export "
            f"the SLURM_CONF it prints): {probe.stderr.strip()[:200]}"
        )
    return None


_REASON = _slurm_reason()
if _REASON:
    pytestmark = [pytest.mark.slurm, pytest.mark.skip(reason=_REASON)]


def sbatch_wait(tmp_path: Path, *args: str, timeout: float = 180):
    """Submit and wait for the end; ``returncode`` is the job's exit code. (Polls every 0.3 s:
    `sbatch -W` checks every 10 s, which made each of these few-second jobs take 10.)"""
    out = tmp_path / "job.out"
    submitted = run_command(
        ["sbatch", "--parsable", f"--output={out}", f"--chdir={tmp_path}", *args], timeout=60
    )
    assert submitted.returncode == 0, submitted.output
    job_id = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    fields: dict[str, str] = {}
    while time.monotonic() < deadline:
        shown = run_command(["scontrol", "show", "job", "-o", job_id], timeout=30).stdout
        fields = dict(item.split("=", 1) for item in shown.split() if "=" in item)
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OOM"):
            break
        time.sleep(0.3)
    else:
        run_command(["scancel", job_id], timeout=30)
        raise AssertionError(f"job {job_id} did not end within {timeout} s: {fields}")
    code, _, signal = fields.get("ExitCode", "1:0").partition(":")
    returncode = int(code) if int(code) or signal in ("", "0") else 128 + int(signal)
    text = out.read_text() if out.exists() else ""
    return Completed(returncode, shown, ""), text


def test_sbatch_single_node_template_runs_hello(tmp_path: Path) -> None:
    result, text = sbatch_wait(tmp_path, str(REPO / "slurm/single_node.sbatch"), str(CONFIGS / "hello.toml"))
    assert result.returncode == 0, result.output + text
    assert "slurm step" in text and "4 tasks" in text
    assert "placement: 4 ranks" in text
    assert "1->1, 2->4, 3->9, 4->16, 5->25, 6->36, 7->49, 8->64" in text
    assert "job 'hello' finished" in text


def test_sbatch_more_tasks_and_extra_args(tmp_path: Path) -> None:
    result, text = sbatch_wait(
        tmp_path,
        "-n",
        "5",
        str(REPO / "slurm/single_node.sbatch"),
        str(CONFIGS / "hello.toml"),
        "--set",
        "components.doubler.num_ranks=3",
    )
    assert result.returncode == 0, result.output + text
    assert "placement: 5 ranks" in text


def test_sbatch_bad_config_fails_with_one_message(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[components.a]\nworker = "job_workers:ProbeWorker"\nnum_rank = 1\n')
    result, text = sbatch_wait(tmp_path, str(REPO / "slurm/single_node.sbatch"), str(bad))
    assert result.returncode == 2, result.output + text
    assert text.count("rlinf-hpc: error:") == 1, text
    assert "Did you mean `num_ranks`?" in text and "Traceback" not in text


def test_batch_script_without_srun_launches_itself(tmp_path: Path) -> None:
    script = tmp_path / "direct.sh"
    script.write_text(f"#!/bin/bash\nrlinf-hpc run {CONFIGS / 'hello.toml'}\n")
    result, text = sbatch_wait(tmp_path, "-n", "4", str(script))
    assert result.returncode == 0, result.output + text
    assert "inside SLURM job" in text and "placement: 4 ranks" in text


def test_a_one_node_srun_step_gives_ucx_shared_memory_only() -> None:
    """MPI_Init of the bundled MPICH/UCX intermittently aborted under srun on this VM's NIC
    (pmodels/mpich#7417); a one-node step now starts UCX with shared memory only."""
    probe = (
        "import os; from rlinf_hpc.comm.mpi import world; w = world(); "
        "print(w.Get_rank(), w.allreduce(1), os.environ.get('UCX_TLS'))"
    )
    result = run_command(["srun", "-n", "3", "--mpi=pmi2", "python", "-c", probe], timeout=120)
    assert result.returncode == 0, result.output
    assert sorted(result.stdout.split("\n")[:3]) == ["0 3 self,sm", "1 3 self,sm", "2 3 self,sm"]


def test_srun_without_pmi_is_explained_once() -> None:
    result = run_command(
        ["srun", "-n", "3", "--mpi=none", "rlinf-hpc", "run", str(CONFIGS / "hello.toml")], timeout=120
    )
    assert result.returncode == 2, result.output
    assert result.stderr.count("the tasks did not join one MPI job") == 1, result.stderr


def test_interactive_helper_runs_srun_inside_salloc() -> None:
    result = run_command(
        [
            "bash",
            str(REPO / "slurm/interactive.sh"),
            "-n",
            "3",
            str(CONFIGS / "hello.toml"),
            "--set",
            "components.doubler.num_ranks=1",
        ],
        timeout=180,
    )
    assert result.returncode == 0, result.output
    assert "placement: 3 ranks" in result.stdout


def _start_probe_job(tmp_path: Path) -> tuple[str, list[int], Path]:
    """A 3-rank probe job under sbatch/srun, running: (job id, rank pids, job.out)."""
    config = tmp_path / "sig.toml"
    config.write_text(
        '[components.alpha]\nworker = "job_workers:ProbeWorker"\n'
        '[components.beta]\nworker = "job_workers:ProbeWorker"\n'
        '[flow]\nrunner = "job_workers:signal_flow"\n'
    )
    out = tmp_path / "job.out"
    submit = run_command(
        [
            "sbatch",
            "--parsable",
            "-n",
            "3",
            f"--output={out}",
            f"--chdir={tmp_path}",  # the run directory under runs/ there
            str(REPO / "slurm/single_node.sbatch"),
            str(config),
        ],
        timeout=30,
    )
    assert submit.returncode == 0, submit.output
    job_id = submit.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and "PIDS " not in (out.read_text() if out.exists() else ""):
        time.sleep(0.2)
    text = out.read_text()
    assert "PIDS " in text, text
    pids = [int(p) for p in text.split("PIDS ", 1)[1].splitlines()[0].split()]
    return job_id, pids, out


def _gone_within(job_id: str, seconds: float) -> float:
    """Seconds until the job left the queue; fails past ``seconds``."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        queue = run_command(["squeue", "-h", "-j", job_id], timeout=30)
        if job_id not in queue.stdout:
            return time.monotonic() - started
        time.sleep(0.3)
    pytest.fail(f"job {job_id} still queued {seconds} s on")


def test_scancel_ends_every_rank(tmp_path: Path) -> None:
    job_id, pids, out = _start_probe_job(tmp_path)
    run_command(["scancel", job_id], timeout=30)
    _gone_within(job_id, 60)
    assert not survivors(pids, grace=15.0), out.read_text()


@pytest.mark.parametrize(("victim", "name"), [(2, "beta"), (0, "coordinator")])
def test_a_rank_killed_under_srun_is_named_and_the_step_ends_within_seconds(
    tmp_path: Path, victim: int, name: str
) -> None:
    """srun answers a task's death with SIGTERM to the others. The run was recorded as ended
    by "SIGTERM" with no culprit, the death watch went with the step before naming anyone,
    rank 0's MPI_Abort returned (srun does not end a step twice) and the ranks that left sat in
    MPI_Finalize until KillWait's SIGKILL: 30 s."""
    job_id, pids, out = _start_probe_job(tmp_path)
    run_dir = next((tmp_path / "runs").iterdir())
    deadline = time.monotonic() + 30
    while not (run_dir / "heartbeats" / "deathwatch.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(pids[victim], signal.SIGKILL)
    took = _gone_within(job_id, 60)
    assert took < 20, (took, out.read_text())  # the finalize bound (10 s) and SLURM's own steps
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "rank died", (summary, out.read_text())
    assert summary["culprit"]["rank"] == victim and summary["culprit"]["component"] == name, summary
    ends = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert all(e["outcome"] == "rank died" for e in ends if e["event"] == "end"), ends
    # a rank whose MPI_Finalize waited out its bound writes its stacks to the run directory:
    # faulthandler's "Timeout (0:00:10)!" and a traceback on stderr read as a second failure
    assert "Timeout (" not in out.read_text(), out.read_text()
    for stacks in (run_dir / "stacks").glob("finalize-rank-*.txt"):
        assert "MPI_Finalize did not return within 10 s" in stacks.read_text()
    assert not survivors(pids, grace=5.0)
