"""The job opens no rendezvous server anyone could reach: link and DDP stores travel over MPI."""

from __future__ import annotations

import pytest

from conftest import BIN, TESTS_DIR, job_env, run_command

pytestmark = pytest.mark.mpi


def test_no_wildcard_listeners_after_links_and_ddp() -> None:
    script = TESTS_DIR / "mpi_programs" / "socket_checks.py"
    env = job_env({"MPIEXEC_TIMEOUT": "150"})
    result = run_command(
        [str(BIN / "mpiexec"), "-n", "2", str(BIN / "python"), str(script)], timeout=180, env=env
    )
    assert result.returncode == 0, result.output
    assert "NO WILDCARD LISTENERS on 2 ranks" in result.stdout, result.output
