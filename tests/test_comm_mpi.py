"""The data plane under the bundled mpiexec with 2 and 4 ranks (tests/mpi_programs/comm_checks.py)."""

from __future__ import annotations

import pytest

from conftest import BIN, TESTS_DIR, job_env, run_command

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_comm_checks(num_ranks: int) -> None:
    env = job_env({"MPIEXEC_TIMEOUT": "240"})
    result = run_command(
        [
            str(BIN / "mpiexec"),
            "-n",
            str(num_ranks),
            str(BIN / "python"),
            str(TESTS_DIR / "mpi_programs" / "comm_checks.py"),
        ],
        timeout=260,
        env=env,
    )
    assert result.returncode == 0, result.output
    assert f"ALL CHECKS OK on {num_ranks} ranks" in result.stdout, result.output
