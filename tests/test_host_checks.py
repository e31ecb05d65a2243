"""The engines' checks of the host before any rank starts: torch companions built for another
torch are named with their fix; bf16 on a CPU that emulates it is warned of with its cost."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from rlinf_hpc.engines import host

from conftest import CONFIGS, job_env, rlinf


def test_a_torchvision_built_for_another_torch_stops_the_job_before_any_rank_starts(tmp_path: Path) -> None:
    """A distribution's metadata is all the check reads: a dist-info pinning torch 2.99.0."""
    info = tmp_path / "site" / "torchvision-0.99.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.99.0\nRequires-Dist: numpy\n"
        "Requires-Dist: torch==2.99.0\n"
    )
    env = job_env()
    env["PYTHONPATH"] = f"{tmp_path / 'site'}:{env['PYTHONPATH']}"
    result = rlinf("run", str(CONFIGS / "math_grpo_tiny.toml"), "--run-dir", str(tmp_path / "run"), env=env)
    assert result.returncode == 2, result.output
    assert "torchvision 0.99.0 (built for torch 2.99.0) installed beside torch" in result.output
    assert "pip uninstall -y torchvision torchaudio torchcodec" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()


@pytest.mark.parametrize(("slowdown", "warned"), [(6.0, True), (0.4, False)])
def test_bf16_on_a_cpu_that_emulates_it_is_warned_of_with_the_measured_cost(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, slowdown: float, warned: bool
) -> None:
    monkeypatch.setattr(host, "bf16_matmul_slowdown", lambda: slowdown)
    with caplog.at_level(logging.WARNING, logger="rlinf_hpc"):
        host.warn_if_bf16_is_slow("bfloat16", ["actor"])
        host.warn_if_bf16_is_slow("float32", ["actor"])  # never measured, never warned
    lines = [r.getMessage() for r in caplog.records if "bfloat16" in r.getMessage()]
    assert len(lines) == int(warned)
    if warned:
        assert "6.0x slower than float32" in lines[0] and 'model.dtype = "float32"' in lines[0]


def test_the_bf16_measurement_is_a_ratio_of_two_timings() -> None:
    ratio = host.bf16_matmul_slowdown(size=64, repeats=1)
    assert 0 < ratio < 1000
