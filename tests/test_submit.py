"""`rlinf-hpc submit`: the generated batch scripts are golden-file tested (regenerate with
``RLINF_UPDATE_GOLDEN=1 pytest tests/test_submit.py`` and review the diff)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlinf_hpc.cli.submit import SubmitOptions, gpus_needed, render_script
from rlinf_hpc.config import load_config

from conftest import CONFIGS, REPO, rlinf

GOLDEN = REPO / "tests" / "golden"


@pytest.mark.parametrize(
    ("config", "options"),
    [
        ("math_grpo_tiny.toml", SubmitOptions(time="00:30:00")),
        ("math_grpo_qwen2.5_7b.toml", SubmitOptions("2-00:00:00", "gpu", 2, 300, ("--account=rl",))),
    ],
)
def test_batch_scripts_match_their_golden_files(config: str, options: SubmitOptions) -> None:
    loaded = load_config(CONFIGS / config, [])
    script = render_script(
        loaded, Path("/runs/x/submitted.toml"), Path("/runs/x"), "/venv/bin/rlinf-hpc", options
    )
    golden = GOLDEN / f"submit_{Path(config).stem}.sbatch"
    if os.environ.get("RLINF_UPDATE_GOLDEN"):
        golden.write_text(script)
    assert script == golden.read_text()


def test_task_and_gpu_counts_follow_the_placement() -> None:
    config = load_config(CONFIGS / "math_grpo_tiny.toml", ["placement.mode=collocated"])
    assert config.num_worker_ranks_needed + 1 == 2 and gpus_needed(config) == 0
    gpu = load_config(CONFIGS / "math_grpo_qwen2.5_7b.toml", [])
    assert gpu.num_worker_ranks_needed == 16 and gpus_needed(gpu) == 16  # reward shares GPU ranks
    alone = load_config(
        CONFIGS / "math_grpo_qwen2.5_7b.toml", ["placement.mode=disaggregated", "placement.groups=[]"]
    )
    assert alone.num_worker_ranks_needed == 32 and gpus_needed(alone) == 24  # reward needs none


def test_dry_run_writes_the_script_and_the_frozen_config(tmp_path: Path) -> None:
    result = rlinf(
        "submit", str(CONFIGS / "math_grpo_tiny.toml"), "--run-dir", str(tmp_path), "--dry-run",
        "--set", "grpo.steps=7", "--", "--mail-type=END",
    )  # fmt: skip
    assert result.returncode == 0, result.output
    script = (tmp_path / "job.sbatch").read_text()
    assert "#SBATCH --ntasks=5" in script and "#SBATCH --mail-type=END" in script
    assert "#SBATCH --signal=B:USR2@120" in script and "#SBATCH --requeue" in script
    assert "steps = 7" in (tmp_path / "submitted.toml").read_text()
    assert "not submitted: --dry-run" in result.stdout
