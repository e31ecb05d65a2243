"""The benchmark scripts keep running and keep writing the JSON their readers expect."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import BIN, REPO, run_command

pytestmark = pytest.mark.mpi

COMM_RATIOS = {
    "tensor64mb_vs_mpi_buffers",
    "tensor64mb_vs_gloo",
    "dict10x6mb_vs_pickle",
    "dict10x6mb_vs_mpi_buffers",
    "latency1kb_vs_pickle",
    "async1kb_vs_pickle_loop",
}


def test_bench_comm_writes_every_ratio(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    # one timed repetition: this checks the tool, not the speed (BENCHMARKS.md has the figures)
    result = run_command(
        [str(BIN / "python"), str(REPO / "tools" / "bench_comm.py"), "--repeats", "1", "--json", str(out)],
        timeout=240,
    )
    assert result.returncode in (0, 1), result.output  # 1 = a ratio missed its bound on a busy box
    data = json.loads(out.read_text())
    assert set(data["ratios"]) == COMM_RATIOS
    assert all(value > 0 for value in data["ratios"].values())
    assert data["raw"]["tensor64mb_mpi_buffers_GBps"] > 0
    assert "ratios (ours / baseline)" in result.stdout
