"""GPU paths of the data plane: run on a CUDA machine, skipped (with the reason) elsewhere."""

from __future__ import annotations

import pytest

from conftest import BIN, TESTS_DIR, job_env, run_command

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU paths untested here"),
]


def test_gpu_comm_checks() -> None:
    result = run_command(
        [
            str(BIN / "mpiexec"),
            "-n",
            "2",
            str(BIN / "python"),
            str(TESTS_DIR / "mpi_programs" / "gpu_checks.py"),
        ],
        timeout=300,
        env=job_env({"MPIEXEC_TIMEOUT": "280"}),
    )
    assert result.returncode == 0, result.output
    assert "ALL GPU CHECKS OK" in result.stdout, result.output
