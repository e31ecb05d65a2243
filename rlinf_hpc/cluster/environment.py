"""What launched this process: a SLURM step, an mpiexec, or nothing (a singleton).

This module is the only place in rlinf_hpc that reads SLURM_*, PMI_*, OMPI_* and PMIX_*
variables. Detection is a pure function of a mapping so it can be tested without a cluster.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from rlinf_hpc.errors import UserError

EnvKind = Literal["slurm", "mpiexec", "singleton"]


@dataclass(frozen=True)
class JobEnvironment:
    """The launcher-provided view of this process, before MPI is initialised.

    ``rank``/``world_size``/``local_rank`` are what the launcher says; MPI is authoritative
    and `check_against_mpi` compares the two.
    """

    kind: EnvKind
    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    launcher: str = "none"
    slurm_job_id: str | None = None
    slurm_step_id: str | None = None
    slurm_num_tasks: int | None = None
    slurm_num_nodes: int | None = None
    slurm_node_list: str | None = None

    @property
    def in_slurm_allocation(self) -> bool:
        """True inside sbatch/salloc, whether or not this process is an srun task."""
        return self.slurm_job_id is not None

    @property
    def needs_launch(self) -> bool:
        """True when `rlinf-hpc run` must start the ranks itself (not inside an MPI/SLURM step)."""
        return self.kind == "singleton"

    def describe(self) -> str:
        """One line for logs, e.g. ``slurm step 42.0 (4 tasks on 1 node)``."""
        if self.kind == "slurm":
            return (
                f"slurm step {self.slurm_job_id}.{self.slurm_step_id} "
                f"({self.slurm_num_tasks} tasks on {self.slurm_num_nodes or '?'} node(s))"
            )
        if self.kind == "mpiexec":
            where = f" inside SLURM job {self.slurm_job_id}" if self.slurm_job_id else ""
            return f"{self.launcher} with {self.world_size} ranks{where}"
        where = f" inside SLURM job {self.slurm_job_id}" if self.slurm_job_id else ""
        return f"singleton process{where}"

    def check_against_mpi(self, mpi_rank: int, mpi_size: int) -> None:
        """Raise `UserError` when the launcher started N tasks but MPI sees a different world.

        The classic case: `srun` with an MPI that does not speak SLURM's PMI, so every task
        becomes its own one-rank MPI world and the job silently runs N copies of rank 0.
        """
        if self.world_size is None or self.world_size == mpi_size:
            return
        how = (
            "Launch with `srun --mpi=pmi2 ...` using an MPI built with PMI2 support (the bundled "
            "MPICH wheel is), or start the job with that MPI's own mpiexec."
            if self.kind == "slurm"
            else "Start every rank with the same MPI library's mpiexec that mpi4py was built against."
        )
        raise UserError(
            f"the launcher ({self.describe()}) started {self.world_size} tasks, but MPI on task "
            f"{self.rank} sees a world of {mpi_size} rank(s) (MPI rank {mpi_rank}): the tasks did "
            f"not join one MPI job. {how}"
        )


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise UserError(
            f"environment variable {name}={raw!r} is not an integer; the launcher environment is "
            "broken. Unset it or start the job through srun/sbatch/mpiexec again."
        ) from None


def _slurm_fields(env: Mapping[str, str]) -> dict[str, object]:
    return {
        "slurm_job_id": env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"),
        "slurm_step_id": env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID"),
        "slurm_num_tasks": _int(env, "SLURM_NTASKS") or _int(env, "SLURM_NPROCS"),
        "slurm_num_nodes": _int(env, "SLURM_JOB_NUM_NODES") or _int(env, "SLURM_NNODES"),
        "slurm_node_list": env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"),
    }


def _check_slurm_consistency(env: Mapping[str, str], fields: dict[str, object]) -> None:
    procid = _int(env, "SLURM_PROCID")
    ntasks = fields["slurm_num_tasks"]
    if procid is None:
        return
    if ntasks is None:
        raise UserError(
            f"inconsistent SLURM environment: SLURM_PROCID={procid} is set but SLURM_NTASKS is not, "
            "so the number of ranks is unknown. Start the job with `srun -n N ...` or `sbatch -n N`, "
            "or unset the stray SLURM_* variables if you are not inside a SLURM job."
        )
    assert isinstance(ntasks, int)
    if not 0 <= procid < ntasks:
        raise UserError(
            f"inconsistent SLURM environment: SLURM_PROCID={procid} is outside 0..{ntasks - 1} "
            f"(SLURM_NTASKS={ntasks}). Start the job through srun/sbatch again, or unset the stray "
            "SLURM_* variables."
        )
    if fields["slurm_job_id"] is None:
        raise UserError(
            "inconsistent SLURM environment: SLURM_PROCID is set but SLURM_JOB_ID is not. Unset "
            "the stray SLURM_* variables, or start the job through srun/sbatch."
        )


def detect_environment(env: Mapping[str, str] | None = None) -> JobEnvironment:
    """Classify the current process from its environment. Raises `UserError` if inconsistent."""
    env = os.environ if env is None else env
    fields = _slurm_fields(env)
    _check_slurm_consistency(env, fields)

    # mpiexec-style launchers first: under `mpiexec` inside an allocation, SLURM_PROCID belongs
    # to the launcher's proxy task, while PMI_RANK is the real MPI rank.
    for launcher, rank_var, size_var, local_var in (
        ("mpiexec (Hydra/PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
        ("mpiexec (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("mpiexec (PMIx)", "PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK"),
    ):
        rank, size = _int(env, rank_var), _int(env, size_var)
        if rank is None:
            continue
        procid, step = _int(env, "SLURM_PROCID"), fields["slurm_step_id"]
        if step is not None and procid == rank and size in (None, fields["slurm_num_tasks"]):
            break  # srun --mpi=pmi2 also sets PMI_RANK; this is a SLURM task.
        if size is not None and not 0 <= rank < size:
            raise UserError(
                f"inconsistent MPI launcher environment: {rank_var}={rank} is outside "
                f"0..{size - 1} ({size_var}={size}). Start the job through mpiexec again."
            )
        return JobEnvironment(
            kind="mpiexec",
            rank=rank,
            world_size=size,
            local_rank=_int(env, local_var),
            launcher=launcher,
            **fields,  # type: ignore[arg-type]
        )

    if fields["slurm_step_id"] is not None and _int(env, "SLURM_PROCID") is not None:
        return JobEnvironment(
            kind="slurm",
            rank=_int(env, "SLURM_PROCID"),
            world_size=fields["slurm_num_tasks"],  # type: ignore[arg-type]
            local_rank=_int(env, "SLURM_LOCALID"),
            launcher="srun",
            **fields,  # type: ignore[arg-type]
        )
    return JobEnvironment(kind="singleton", **fields)  # type: ignore[arg-type]
