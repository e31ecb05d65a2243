"""Job environment detection from launcher variables (no cluster needed: pure mappings)."""

from __future__ import annotations

import pytest

from rlinf_hpc.cluster import detect_environment
from rlinf_hpc.cluster.devices import _visible_indices
from rlinf_hpc.comm.mpi import PMI2_PLUGIN_NETMOD, default_transports
from rlinf_hpc.errors import UserError

SRUN_TASK = {  # what `srun --mpi=pmi2 -n 2` gave task 1 on the local cluster
    "SLURM_JOB_ID": "7",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "2",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0",
    "SLURM_JOB_NUM_NODES": "1",
    "PMI_RANK": "1",
    "PMI_SIZE": "2",
    "PMI_FD": "13",
}
BATCH_STEP = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}
HYDRA = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "3", "PMI_FD": "9"}


def test_singleton() -> None:
    env = detect_environment({})
    assert env.kind == "singleton" and env.needs_launch and not env.in_slurm_allocation


def test_srun_task_is_a_slurm_step() -> None:
    env = detect_environment(SRUN_TASK)
    assert (env.kind, env.rank, env.world_size, env.local_rank) == ("slurm", 1, 2, 1)
    assert not env.needs_launch
    assert "slurm step 7.0" in env.describe()


def test_batch_script_is_an_allocation_not_a_step() -> None:
    env = detect_environment(BATCH_STEP)
    assert env.kind == "singleton" and env.needs_launch and env.in_slurm_allocation
    assert env.slurm_num_tasks == 4


def test_hydra_mpiexec() -> None:
    env = detect_environment(HYDRA)
    assert (env.kind, env.rank, env.world_size, env.local_rank) == ("mpiexec", 3, 4, 3)


def test_mpiexec_inside_allocation_uses_pmi_rank_not_proxy_procid() -> None:
    # Hydra under SLURM: srun starts one proxy task per node; PMI_RANK is the MPI rank.
    env = detect_environment(
        {**HYDRA, "SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    )
    assert (env.kind, env.rank, env.world_size) == ("mpiexec", 3, 4)
    assert "inside SLURM job 9" in env.describe()


def test_open_mpi_variables() -> None:
    env = detect_environment(
        {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    )
    assert (env.kind, env.rank, env.world_size, env.local_rank) == ("mpiexec", 1, 2, 1)
    assert "Open MPI" in env.launcher


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"SLURM_PROCID": "1", "SLURM_JOB_ID": "3"}, "SLURM_PROCID=1 is set but SLURM_NTASKS is not"),
        ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "3"}, "outside 0..3"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_JOB_ID is not"),
        ({"SLURM_NTASKS": "four", "SLURM_PROCID": "0"}, "SLURM_NTASKS='four' is not an integer"),
        ({"PMI_RANK": "5", "PMI_SIZE": "2"}, "PMI_RANK=5 is outside 0..1"),
    ],
)
def test_inconsistent_environment_is_a_user_error(variables: dict[str, str], message: str) -> None:
    with pytest.raises(UserError, match=message):
        detect_environment(variables)


def test_mpi_world_mismatch_explains_pmi() -> None:
    env = detect_environment(SRUN_TASK)
    env.check_against_mpi(1, 2)  # consistent: no error
    with pytest.raises(UserError, match=r"started 2 tasks, but MPI .* sees a world of 1.*--mpi=pmi2"):
        env.check_against_mpi(0, 1)


@pytest.mark.parametrize(
    ("cuda_visible", "physical", "expected"),
    [
        (None, 2, [0, 1]),
        ("", 2, []),
        ("1", 2, [1]),
        ("0,5,1", 2, [0]),
        ("GPU-abc,GPU-def", 4, [0, 1]),
        ("-1", 2, []),
    ],
)
def test_cuda_visible_devices(cuda_visible: str | None, physical: int, expected: list[int]) -> None:
    env = {} if cuda_visible is None else {"CUDA_VISIBLE_DEVICES": cuda_visible}
    assert _visible_indices(physical, env) == expected


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({**SRUN_TASK, "SLURM_STEP_NUM_NODES": "1"}, "self,sm"),  # srun step on one node
        ({**SRUN_TASK, "SLURM_STEP_NUM_NODES": "2"}, None),  # across nodes UCX needs the network
        ({**HYDRA, "RLINF_HPC_LAUNCHED": "1"}, "self,sm"),  # rlinf-hpc's own local mpiexec
        ({**HYDRA, "RLINF_HPC_LAUNCHED": "1", "SLURM_JOB_ID": "7"}, None),  # Hydra may span nodes
        (HYDRA, None),  # a user's mpiexec: hosts unknown
        ({**SRUN_TASK, "SLURM_STEP_NUM_NODES": "1", "UCX_TLS": "tcp"}, "tcp"),  # the user's choice
    ],
)
def test_single_node_jobs_give_ucx_shared_memory_only(
    variables: dict[str, str], expected: str | None
) -> None:
    environ = dict(variables)
    default_transports(environ)
    assert environ.get("UCX_TLS") == expected


PMI2_STEP = {**SRUN_TASK, "SLURM_MPI_TYPE": "pmi2"}


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({**PMI2_STEP, "SLURM_STEP_NUM_NODES": "2"}, PMI2_PLUGIN_NETMOD),  # across nodes: OFI
        ({**PMI2_STEP, "SLURM_STEP_NUM_NODES": "1"}, None),  # one node: UCX over shared memory
        ({**PMI2_STEP, "SLURM_STEP_NUM_NODES": "2", "MPIR_CVAR_CH4_NETMOD": "ucx"}, "ucx"),  # the user's
        ({**PMI2_STEP, "SLURM_STEP_NUM_NODES": "2", "MPICH_CH4_NETMOD": "ucx"}, None),  # other spelling
        ({**SRUN_TASK, "SLURM_MPI_TYPE": "pmix", "SLURM_STEP_NUM_NODES": "2"}, None),  # PMIx frames fine
        ({k: v for k, v in PMI2_STEP.items() if k != "PMI_FD"} | {"SLURM_STEP_NUM_NODES": "2"}, None),
    ],
)
def test_multi_node_pmi2_steps_get_mpich_over_ofi(variables: dict[str, str], expected: str | None) -> None:
    """Slurm's pmi2 plugin cuts PMI-1 lines over 1024 bytes; UCX's business card makes such lines
    across nodes (the hetjob's MPI_Init failures), OFI's does not: see comm/mpi.py."""
    environ = dict(variables)
    chosen = default_transports(environ)
    assert environ.get("MPIR_CVAR_CH4_NETMOD") == expected
    assert ("MPIR_CVAR_CH4_NETMOD" in chosen) == (expected == PMI2_PLUGIN_NETMOD)
