"""Start the job's ranks when `rlinf-hpc` runs outside any MPI or SLURM step.

The embedded default is the venv's own `mpiexec` (from the `mpich` extra), which also works
inside an sbatch/salloc allocation (Hydra then starts its proxies through srun).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import NoReturn

from rlinf_hpc.cluster import JobEnvironment
from rlinf_hpc.comm.mpi import LAUNCHED_MARK as _LAUNCHED_MARK
from rlinf_hpc.comm.waiting import timer_slack_ns
from rlinf_hpc.errors import UserError
from rlinf_hpc.log import get_logger

log = get_logger("launch")


def find_mpiexec() -> str:
    """The venv's mpiexec, else the first one on PATH. Raises `UserError` when there is none."""
    beside_python = Path(sys.executable).parent / "mpiexec"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("mpiexec")
    if found:
        return found
    raise UserError(
        f"no mpiexec next to {sys.executable} or on PATH, so rlinf-hpc cannot start the job's "
        "ranks. Install the bundled MPI with `pip install 'rlinf_hpc[mpich]'`, or start the job "
        "yourself with `srun`/`mpiexec -n N rlinf-hpc run CONFIG`."
    )


def launch_ranks(num_ranks: int, environment: JobEnvironment, argv: list[str]) -> NoReturn:
    """Replace this process with ``mpiexec -n num_ranks python -m rlinf_hpc ARGV``."""
    exec_under_mpiexec(num_ranks, ["-m", "rlinf_hpc", *argv], environment, "rlinf-hpc")


def relaunch_script_if_needed(num_ranks: int) -> None:
    """For scripts such as tools/bench_*.py: outside an MPI/SLURM step, re-run this script
    (same arguments) as ``num_ranks`` ranks under the venv's mpiexec; inside one, return."""
    from rlinf_hpc.cluster import detect_environment

    environment = detect_environment()
    if environment.needs_launch:
        exec_under_mpiexec(num_ranks, list(sys.argv), environment, Path(sys.argv[0]).name)


def exec_under_mpiexec(
    num_ranks: int, python_args: list[str], environment: JobEnvironment, label: str
) -> NoReturn:
    """Replace this process with ``mpiexec -n num_ranks python PYTHON_ARGS``."""
    if os.environ.get(_LAUNCHED_MARK):
        raise UserError(
            f"{label} started itself under mpiexec, but the ranks still see no MPI launcher "
            "environment (no PMI_RANK/OMPI_* variables): the mpiexec found does not match the "
            "MPI library mpi4py uses. Reinstall with `pip install 'rlinf_hpc[mpich]'`."
        )
    timer_slack_ns(os.environ)  # a bad value is refused here, once, not by every rank
    mpiexec = find_mpiexec()
    command = [mpiexec, "-n", str(num_ranks), sys.executable, *python_args]
    where = f" inside SLURM job {environment.slurm_job_id}" if environment.in_slurm_allocation else ""
    sys.stderr.write(f"{label}: starting {num_ranks} ranks with {mpiexec}{where}\n")
    sys.stderr.flush()
    os.environ[_LAUNCHED_MARK] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share the node's cores
    os.execv(mpiexec, command)
