"""Randomized pipelines over the data plane and channels at 17 and 32 ranks, in integrity
mode (tests/mpi_programs/stress_checks.py): exact results, no torn message, no deadlock."""

from __future__ import annotations

import pytest

from conftest import BIN, TESTS_DIR, job_env, run_command

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize(
    ("num_ranks", "examples"),
    # 17 ranks is past the 16-17 where messages were once corrupted; 32 is the same checks at
    # twice the ranks (1 minute of CI on 2 cores, and its 32 processes starve the other worker)
    [(5, 10), (17, 12), pytest.param(32, 8, marks=pytest.mark.slow)],
)
def test_random_pipelines(num_ranks: int, examples: int) -> None:
    env = job_env({"MPIEXEC_TIMEOUT": "280", "STRESS_EXAMPLES": str(examples)})
    program = TESTS_DIR / "mpi_programs" / "stress_checks.py"
    command = [str(BIN / "mpiexec"), "-n", str(num_ranks), str(BIN / "python"), str(program)]
    result = run_command(command, timeout=300, env=env)
    assert result.returncode == 0, result.output[-5000:]
    assert f"ALL STRESS CHECKS OK on {num_ranks} ranks" in result.stdout, result.output[-5000:]
    assert result.stdout.count(" ok in ") >= examples, result.stdout
