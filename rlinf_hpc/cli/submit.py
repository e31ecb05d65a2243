"""`rlinf-hpc submit CONFIG`: the batch script for a long job, written, shown and submitted.

The script runs the config as resolved now (frozen into ``RUN_DIR/submitted.toml``, so a
requeued run trains exactly what was submitted), with the task count from the placement and
the GPUs from the components, and asks SLURM for what checkpoint-restart needs:
``--signal=B:USR2@SECONDS`` (the batch shell forwards it to the ranks: save and stop at the
next step boundary), ``--requeue`` and ``--open-mode=append`` (one log across requeues).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rlinf_hpc.config import Config, config_to_toml, load_config
from rlinf_hpc.errors import UserError


@dataclass(frozen=True)
class SubmitOptions:
    time: str = "04:00:00"
    partition: str | None = None
    nodes: int = 1
    signal_seconds: int = 120
    extra: tuple[str, ...] = ()


def gpus_needed(config: Config) -> int:
    """Worker ranks that need a GPU (components with ``device = "gpu"``; shared ranks once)."""
    return sum(
        config.unit_size(unit)
        for unit in config.placement_units()
        if any(config.components[n].device == "gpu" for n in unit)
    )


def render_script(
    config: Config, config_file: Path, run_dir: Path, rlinf: str, options: SubmitOptions
) -> str:
    """The batch script (pure: the golden-file tests compare it byte for byte)."""
    tasks = config.num_worker_ranks_needed + 1
    lines = [
        "#!/bin/bash",
        f"# Written by `rlinf-hpc submit` for {config.job.name}: {tasks} tasks (coordinator + "
        f"{tasks - 1} worker ranks from the placement).",
        "# Checkpoint-restart: SIGUSR2 before the time limit -> save at the next step boundary,",
        "# `scontrol requeue`, and the requeued run resumes from the newest complete checkpoint.",
        f"#SBATCH --job-name={config.job.name}",
        f"#SBATCH --nodes={options.nodes}",
        f"#SBATCH --ntasks={tasks}",
        "#SBATCH --cpus-per-task=1",
        f"#SBATCH --time={options.time}",
    ]
    if options.partition:
        lines.append(f"#SBATCH --partition={options.partition}")
    gpus = gpus_needed(config)
    if gpus:
        lines.append(f"#SBATCH --gpus={gpus}")
    lines += [
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:USR2@{options.signal_seconds}",
        *(f"#SBATCH {flag}" for flag in options.extra),
        "set -uo pipefail",
        "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}",
        'echo "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST:-?}: '
        f'{config.job.name}"',
        "# A restart gets a new step id first: MPICH names its shared-memory segments after",
        "# job.step, and those of a killed step (in /dev/shm) would be attached to and hang.",
        'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then srun --ntasks=1 --nodes=1 true; fi',
        "# The batch shell gets SIGUSR2 (B:); srun passes it on to every rank.",
        'forward() { kill -USR2 "$child" 2>/dev/null; }',
        "trap forward USR2",
        f"srun --mpi=pmi2 --kill-on-bad-exit=1 {shlex.quote(rlinf)} run {shlex.quote(str(config_file))} "
        f"--run-dir {shlex.quote(str(run_dir))} &",
        "child=$!",
        "# wait returns early when a signal arrives; wait again until srun itself ends",
        'while wait "$child"; status=$?; kill -0 "$child" 2>/dev/null; do :; done',
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def _rlinf_executable() -> str:
    beside = Path(sys.executable).parent / "rlinf-hpc"
    return str(beside) if beside.exists() else (shutil.which("rlinf-hpc") or "rlinf-hpc")


def submit(
    config_path: str, overrides: list[str], run_dir: str | None, options: SubmitOptions, dry_run: bool
) -> int:
    config = load_config(config_path, overrides)
    target = Path(run_dir or f"runs/{config.job.name}").resolve()
    try:
        target.mkdir(parents=True, exist_ok=True)
        frozen = target / "submitted.toml"
        frozen.write_text(config_to_toml(config), encoding="utf-8")
        script = target / "job.sbatch"
        script.write_text(
            render_script(config, frozen, target, _rlinf_executable(), options), encoding="utf-8"
        )
    except OSError as exc:
        raise UserError(
            f"cannot write the batch script into run directory '{target}' ({exc.strerror or exc}); "
            "pass a writable --run-dir."
        ) from None
    sys.stdout.write(script.read_text(encoding="utf-8"))
    if dry_run:
        sys.stdout.write(f"written to {script} (not submitted: --dry-run)\n")
        return 0
    if shutil.which("sbatch") is None:
        raise UserError(
            f"sbatch is not on PATH, so the job cannot be submitted; the script is in {script} "
            "(submit it from a login node with `sbatch` there)."
        )
    result = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(f"sbatch refused {script}: {result.stderr.strip()}")
    job_id = result.stdout.strip().split(";")[0]
    sys.stdout.write(f"submitted job {job_id}; output: {target}/slurm-{job_id}.out; run directory {target}\n")
    return 0
