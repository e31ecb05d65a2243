"""Channels under the bundled mpiexec with 3 and 5 ranks (tests/mpi_programs/channel_checks.py)."""

from __future__ import annotations

import pytest

from conftest import BIN, TESTS_DIR, job_env, run_command

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("num_ranks", [3, 5])
def test_channel_checks(num_ranks: int) -> None:
    programs = TESTS_DIR / "mpi_programs"
    env = job_env({"MPIEXEC_TIMEOUT": "200"})
    env["PYTHONPATH"] = f"{programs}:{env['PYTHONPATH']}"
    result = run_command(
        [
            str(BIN / "mpiexec"),
            "-n",
            str(num_ranks),
            str(BIN / "python"),
            str(programs / "channel_checks.py"),
        ],
        timeout=220,
        env=env,
    )
    assert result.returncode == 0, result.output
    assert f"ALL CHANNEL CHECKS OK on {num_ranks} ranks" in result.stdout, result.output
