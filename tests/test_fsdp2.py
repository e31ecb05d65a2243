"""FSDP2 as the actor's third backend: it trains what DDP trains, its state is sharded
(a rank holds about half of DDP's at 2 ranks), and its checkpoint goes through
torch.distributed.checkpoint: saved by 2 actor ranks, resumed on 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import CONFIGS, TINY, rlinf

pytestmark = pytest.mark.mpi

SETS = [
    *[s for s in TINY if not s.startswith(("grpo.steps=", "flow.runner="))],
    "sft.stop_at_accuracy=0", "pipeline.elastic=false", "checkpoint.every_steps=1",
    "grpo.micro_batch_tokens=40",  # several micro-batches per minibatch, their counts aligned
    # one optimizer step per RL step: its gradient is the same at any actor width (minibatches
    # are cut from each rank's share, so at 2 they would hold other samples than at 1)
    "grpo.minibatches=1", "grpo.update_epochs=1",
]  # fmt: skip


def _job(run_dir: Path, np: int, *sets: str) -> object:
    args = ["run", str(CONFIGS / "math_grpo_tiny.toml"), "--np", str(np), "--run-dir", str(run_dir)]
    for item in [*SETS, *sets]:
        args += ["--set", item]
    return rlinf(*args, timeout=240)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_fsdp2_trains_like_ddp_and_resumes_its_sharded_state_on_fewer_ranks(tmp_path: Path) -> None:
    two = ["components.actor.num_ranks=2"]
    ddp = _job(tmp_path / "ddp", 6, *two, "grpo.steps=1")
    assert ddp.returncode == 0, ddp.output
    sharded = tmp_path / "fsdp2"
    first = _job(sharded, 6, *two, "grpo.train_backend=fsdp2", "grpo.steps=2")
    assert first.returncode == 0, first.output
    # the same samples and weights at step 1: the same loss, a gradient of the same norm
    a, b = _records(tmp_path / "ddp")[0], _records(sharded)[0]
    assert a["reward"] == b["reward"] and a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    step = sorted((sharded / "checkpoints").glob("step-*[0-9]"))[-1]
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["components"]["actor"] == {"ranks": 2, "replicated": False, "reshardable": True}
    assert {"actor-dcp/.metadata", "actor-dcp/__0_0.distcp", "actor-dcp/__1_0.distcp"} <= manifest[
        "files"
    ].keys()
    narrower = _job(sharded, 5, "grpo.train_backend=fsdp2", "grpo.steps=4", "components.actor.num_ranks=1")
    assert narrower.returncode == 0, narrower.output
    assert "component 'actor' had 2 rank(s), now 1: its sharded state is re-sharded" in narrower.output
    assert "(step 2, saved for: end)" in narrower.output
    records = _records(sharded)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # the one rank trains on from the saved policy and Adam moments: steps 3 and 4 are those
    # of a run that never stopped (2 ranks), up to the order of the sums
    reference = _job(tmp_path / "reference", 6, *two, "grpo.train_backend=fsdp2", "grpo.steps=4")
    assert reference.returncode == 0, reference.output
    for mine, theirs in zip(records[2:], _records(tmp_path / "reference")[2:], strict=True):
        assert mine["reward"] == theirs["reward"]
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-4, abs=1e-6)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)


def test_fsdp2_refuses_a_warm_start_that_generates_on_each_rank() -> None:
    from rlinf_hpc.config import load_config
    from rlinf_hpc.errors import UserError

    with pytest.raises(UserError, match="sft.stop_at_accuracy = 0.3"):
        load_config(CONFIGS / "math_grpo_tiny.toml", ["grpo.train_backend=fsdp2", "sft.stop_at_accuracy=0.3"])
    load_config(CONFIGS / "math_grpo_tiny.toml", ["grpo.train_backend=fsdp2", "sft.stop_at_accuracy=0"])
