"""`rlinf_hpc.init()` in a plain script under mpiexec (no rlinf-hpc CLI, no coordinator)."""

from __future__ import annotations

import pytest

from conftest import run_mpi_program

pytestmark = pytest.mark.mpi


def test_plain_script_uses_the_data_plane_under_mpiexec() -> None:
    result = run_mpi_program(4, "standalone_script.py")
    assert result.returncode == 0, result.output
    assert "STANDALONE OK on 4 ranks" in result.stdout, result.output


def test_unknown_backend_is_refused() -> None:
    import rlinf_hpc

    with pytest.raises(ValueError, match="choose one of auto, mpi, gloo, nccl"):
        rlinf_hpc.init(backend="ucx")
