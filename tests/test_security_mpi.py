"""The job opens no rendezvous server anyone could reach: link and DDP stores travel over MPI."""

from __future__ import annotations

import pytest

from conftest import run_mpi_program

pytestmark = pytest.mark.mpi


def test_no_wildcard_listeners_after_links_and_ddp() -> None:
    result = run_mpi_program(2, "socket_checks.py")
    assert result.returncode == 0, result.output
    assert "NO WILDCARD LISTENERS on 2 ranks" in result.stdout, result.output
