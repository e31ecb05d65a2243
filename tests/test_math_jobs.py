"""The math GRPO job end to end on tiny settings, in every placement (multi-rank jobs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import CONFIGS, TINY, make_tiny_hf_model, rlinf

PLACEMENTS = {
    # disaggregated (the config's placement, with TensorBoard): the fixed-seed test's runs
    "disaggregated": (5, ["grpo.tensorboard=true"]),
    "collocated": (3, [f"components.{c}.num_ranks=2" for c in ("rollout", "reward", "inference", "actor")]),
    "hybrid": (4, ['placement.groups=[["rollout", "inference"]]']),
    "auto": (5, ["placement.auto_warmup_steps=1"]),
}
#: Every component on one worker rank: for checks that do not depend on the placement (a job
#: of 2 ranks starts in less than half the CPU time of 5: each rank imports torch).
ONE_WORKER = ["placement.mode=collocated"]


def _run(tmp_path: Path, np: int, sets: list[str], name: str = "run") -> tuple[dict, str]:
    args = ["run", str(CONFIGS / "math_grpo_tiny.toml"), "--np", str(np), "--run-dir", str(tmp_path / name)]
    for item in sets:
        args += ["--set", item]
    result = rlinf(*args, timeout=300)
    assert result.returncode == 0, result.output
    return json.loads((tmp_path / name / "summary.json").read_text()), result.stdout


def _check_run(run_dir: Path, summary: dict, stdout: str, steps: int) -> tuple[list[str], list[dict]]:
    """What every placement's run must show; the actor ranks' weight digests and the metrics."""
    assert summary["outcome"] == "ok" and summary["steps"] == steps
    for key in ("eval_accuracy_start", "eval_accuracy_end"):
        assert 0.0 <= summary[key] <= 1.0
    assert summary["wall_seconds"] > 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["tokens"] > 0 and m["weight_sync_s"] >= 0 and "eval_accuracy" in m for m in metrics)
    assert (run_dir / "progress.png").stat().st_size > 1000
    digests = json.loads(next(line for line in stdout.splitlines() if line.startswith("DIGESTS "))[8:])
    actor = digests["actor"]
    assert len(set(actor)) == 1  # data-parallel ranks hold identical weights after the updates
    assert set(digests["rollout"]) == set(actor) and set(digests["inference"]) == set(actor)  # synced
    return actor, metrics


@pytest.mark.parametrize("mode", sorted(set(PLACEMENTS) - {"disaggregated"}))
def test_two_grpo_steps_in_every_placement(tmp_path: Path, mode: str) -> None:
    np, extra = PLACEMENTS[mode]
    summary, stdout = _run(tmp_path, np, [*TINY, f"placement.mode={mode}", *extra])
    actor, metrics = _check_run(tmp_path / "run", summary, stdout, 2)
    if mode == "collocated":
        assert len(actor) == 2  # DDP over two ranks
        assert any(m["switch_s"] > 0 for m in metrics)  # components took turns on the ranks


def test_fixed_seed_gives_the_same_numbers_and_off_policy_starts_on_policy(tmp_path: Path) -> None:
    """Two runs of one seed agree to the last bit, whatever their micro-batches (batch-invariant
    forwards: run b puts every prompt of a step in one micro-batch, run a starts at 2 and lets
    elastic sizes follow timing); one-step off-policy (run c) trains its first step on the
    same on-policy samples (the same numbers with the plain objective: the decoupled one's
    proximal policy moves within the update), then on samples one update old."""
    np, extra = PLACEMENTS["disaggregated"]
    sets = [*[s for s in TINY if not s.startswith("grpo.steps=")], "grpo.steps=3", *extra]
    first, stdout = _run(tmp_path, np, sets, "a")
    _check_run(tmp_path / "a", first, stdout, 3)  # the disaggregated placement's run
    assert list((tmp_path / "a" / "tensorboard").glob("events.out.tfevents.*"))  # beside metrics.jsonl
    second, _ = _run(tmp_path, np, [*sets, "pipeline.micro_batch=8", "pipeline.elastic=false"], "b")
    third, _ = _run(tmp_path, np, [*sets, "grpo.off_policy_steps=1", "grpo.decoupled_loss=false"], "c")
    keys = ("reward", "loss", "pg_loss", "ppo_kl", "entropy", "grad_norm", "sample_accuracy", "eval_accuracy")
    rows = [
        [
            {k: m[k] for k in keys}
            for m in map(json.loads, (tmp_path / n / "metrics.jsonl").read_text().splitlines())
        ]
        for n in "abc"
    ]
    assert rows[0] == rows[1]
    assert first["eval_accuracy_end"] == second["eval_accuracy_end"]
    assert rows[2][0] == rows[0][0] and rows[2][1]["ppo_kl"] != rows[0][1]["ppo_kl"]
    lags = [json.loads(line)["policy_lag"] for line in (tmp_path / "c" / "metrics.jsonl").open()]
    assert lags == [0, 1, 1] and third["off_policy_steps"] == 1 and third["mean_policy_lag"] == 2 / 3


def test_decoupled_loss_weights_stale_samples_by_the_behaviour_policy(tmp_path: Path) -> None:
    """Off-policy with the decoupled objective (the default): the first step's samples are
    on-policy, so each minibatch's proximal policy (its log-probs at its first forward) is the
    behaviour policy or one optimizer step from it, and the weights stay within 1e-3 of 1;
    later steps' samples are one update old and their weights move further."""
    sets = [*[s for s in TINY if not s.startswith("grpo.steps=")], "grpo.steps=3", *ONE_WORKER]
    summary, _ = _run(tmp_path, 2, [*sets, "grpo.off_policy_steps=1"])
    assert summary["outcome"] == "ok" and summary["off_policy_steps"] == 1
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [m["policy_lag"] for m in metrics] == [0, 1, 1]
    assert abs(metrics[0]["behaviour_weight"] - 1.0) < 1e-3 and metrics[0]["behaviour_capped"] == 0.0
    assert all(m["behaviour_weight"] != 1.0 for m in metrics)
    assert max(abs(m["behaviour_weight"] - 1.0) for m in metrics[1:]) > abs(
        metrics[0]["behaviour_weight"] - 1.0
    )


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["model.path=/nonexistent/model"], "model.path = '/nonexistent/model' is not a directory"),
        (
            ["task.kind=jsonl", "task.train_path=/nonexistent.jsonl", "task.eval_path=/x.jsonl"],
            "is not a file",
        ),
        (["grpo.group_size=1"], "grpo.group_size = 1"),
        (["components.actor.num_ranks=3", "--np", "7"], "cannot be split evenly over 3 actor rank"),
        (["grpo.off_policy_steps=2"], "grpo.off_policy_steps"),
    ],
)
def test_bad_inputs_stop_before_training(tmp_path: Path, sets: list[str], message: str) -> None:
    args = ["run", str(CONFIGS / "math_grpo_tiny.toml"), "--run-dir", str(tmp_path / "run")]
    for item in sets:
        args += [item] if item.startswith("--") or item.isdigit() else ["--set", item]
    result = rlinf(*args, timeout=120)
    assert result.returncode == 2, result.output
    assert message in result.output
    assert "warm start" not in result.output  # nothing trained


def test_job_runs_from_a_local_hugging_face_directory(tmp_path: Path) -> None:
    """model.path: a causal LM and its tokenizer saved locally (made here: no download)."""
    model_dir = make_tiny_hf_model(tmp_path / "model")
    summary, _ = _run(tmp_path, 2, [*TINY, f"model.path={model_dir}", *ONE_WORKER])
    assert summary["outcome"] == "ok" and summary["steps"] == 2


def test_warm_start_cache_is_reused_and_a_damaged_one_retrained(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    sets = [*[s for s in TINY if not s.startswith("sft.cache_dir")], f"sft.cache_dir={cache}"]
    sets += ONE_WORKER
    first, _ = _run(tmp_path, 2, sets, "first")
    assert first["warm_start"]["cached"] is False
    (saved,) = cache.glob("sft-*.pt")
    second, _ = _run(tmp_path, 2, sets, "second")
    assert second["warm_start"]["cached"] is True
    assert second["eval_accuracy_start"] == first["eval_accuracy_start"]
    saved.write_bytes(b"not a checkpoint")
    args = ["run", str(CONFIGS / "math_grpo_tiny.toml"), "--np", "2", "--run-dir", str(tmp_path / "third")]
    for item in sets:
        args += ["--set", item]
    result = rlinf(*args, timeout=300)
    assert result.returncode == 0, result.output
    assert "is unusable" in result.output and "training again" in result.output
    third = json.loads((tmp_path / "third" / "summary.json").read_text())
    assert (
        third["warm_start"]["cached"] is False
        and third["eval_accuracy_start"] == first["eval_accuracy_start"]
    )
