"""Data-plane failure paths under the bundled mpiexec (tests/mpi_programs/hardening_checks.py)."""

from __future__ import annotations

import pytest

from conftest import BIN, TESTS_DIR, job_env, run_command

pytestmark = pytest.mark.mpi
PROGRAM = TESTS_DIR / "mpi_programs" / "hardening_checks.py"


def run_program(num_ranks: int, extra: dict[str, str] | None = None):  # noqa: ANN201
    env = job_env({"MPIEXEC_TIMEOUT": "200", **(extra or {})})
    command = [str(BIN / "mpiexec"), "-n", str(num_ranks), str(BIN / "python"), str(PROGRAM)]
    return run_command(command, timeout=220, env=env)


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_hardening_checks(num_ranks: int) -> None:
    result = run_program(num_ranks)
    assert result.returncode == 0, result.output
    assert f"ALL CHECKS OK on {num_ranks} ranks" in result.stdout, result.output


def test_a_subset_run_says_so_and_unknown_names_fail() -> None:
    result = run_program(2, {"HARDENING_CHECKS": "integrity_mode"})
    assert result.returncode == 0, result.output
    assert "ALL CHECKS OK" not in result.stdout, result.output
    assert "ONLY ['integrity_mode'] (set by $HARDENING_CHECKS) OK on 2 ranks" in result.stdout
    result = run_program(2, {"HARDENING_CHECKS": "integrity_mode,no_such_check"})
    assert result.returncode != 0 and "unknown checks ['no_such_check']" in result.stderr, result.output
