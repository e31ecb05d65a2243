"""The emulated-accelerator workload (`emulated_rl`): its cost model, its config checks, and a
job on 8 ranks whose rollout streams responses downstream while its batch still decodes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rlinf_hpc.apps.emulated.profiles import PROFILES
from rlinf_hpc.config import load_config
from rlinf_hpc.errors import UserError
from rlinf_hpc.scheduler.cost_model import fit_engine
from rlinf_hpc.scheduler.elastic import micro_batch_bound

from conftest import CONFIGS, rlinf

PROFILE = PROFILES["grpo-7b"]


def test_generation_waits_on_its_longest_response_and_batches_pay() -> None:
    """The rollout model: a call lasts at least alpha x its longest response (the long tail),
    responses end in order of length, and bigger calls cost less per response."""
    short, tail = [500] * 16, [500] * 15 + [2000]
    assert PROFILE.rollout_seconds(tail) > 2 * PROFILE.rollout_seconds(short)
    seconds, ends = PROFILE.rollout_schedule([300, 900, 600])
    assert ends[0] < ends[2] < ends[1] == pytest.approx(seconds)
    rng = random.Random(0)
    per_item = {
        k: sum(PROFILE.rollout_seconds(PROFILE.lengths(rng, k)) for _ in range(200)) / (200 * k)
        for k in (8, 32, 128)
    }
    assert per_item[8] > 1.5 * per_item[32] > 1.5 * 1.2 * per_item[128]
    lengths = PROFILE.lengths(random.Random(1), 10_000)
    assert 0.03 < sum(n >= PROFILE.long[0] for n in lengths) / len(lengths) < 0.07  # the 5% tail


class _Feed:
    """What `Feed` gives an engine, without a channel: ``arrivals[i]`` more items become
    available at the engine's i-th take."""

    def __init__(self, items: list[dict], arrivals: list[int]) -> None:
        self.items, self.arrivals, self.ended = list(items), list(arrivals), False
        self.available = 0
        self.slots: int | None = None
        self.reports: list[tuple[int, int, list[int]]] = []

    def progress(self, decode_steps: int, active: int, finished: list[int] = ()) -> None:
        self.reports.append((decode_steps, active, list(finished)))

    def take(self, max_items: int, wait: bool = False) -> list[dict]:
        self.available += self.arrivals.pop(0) if self.arrivals else 0
        count = min(max_items, self.available, len(self.items))
        out, self.items = self.items[:count], self.items[count:]
        self.available -= count
        self.ended = not self.items
        return out


def _engine(lengths: list[int], arrivals: list[int]) -> tuple[object, list[list[dict]]]:
    from rlinf_hpc.apps.emulated.workers import EmulatedStage

    stage = EmulatedStage.__new__(EmulatedStage)  # no job: the profile and a tiny time scale
    stage.profile, stage.cost, stage.scale, stage._in_work = PROFILE, PROFILE.stages["rollout"], 1e-6, 0
    stage._reset()
    feed = _Feed([{"uid": i, "length": n} for i, n in enumerate(lengths)], arrivals)
    stage.feed = feed
    return stage, list(stage.engine(feed))


def test_engine_costs_what_a_generate_call_costs_and_streams_in_order_of_length() -> None:
    """The continuous engine, given the whole batch at once, charges exactly the micro-batch
    model's time (greedy slots = requests joining as slots free) and yields each response
    when done; fed in pieces, requests join the running batch."""
    lengths = PROFILE.lengths(random.Random(3), 3 * PROFILE.slots + 5)
    stage, chunks = _engine(lengths, [len(lengths)])
    assert stage._slept == pytest.approx(PROFILE.rollout_seconds(lengths))
    done = [item["length"] for chunk in chunks for item in chunk]
    assert sorted(done) == sorted(lengths) and done[0] == min(lengths[: PROFILE.slots])
    assert stage._useful == pytest.approx(PROFILE.decode_step_s * sum(lengths) / PROFILE.slots)
    # the same work arriving in two halves: the second half joins the running batch, so the
    # whole costs far less than two separate generate calls of a half each
    half = len(lengths) // 2
    stage, chunks = _engine(lengths, [half] + [0] * 10 + [len(lengths) - half])
    apart = PROFILE.rollout_seconds(lengths[:half]) + PROFILE.rollout_seconds(lengths[half:])
    assert sum(len(c) for c in chunks) == len(lengths)
    assert stage._slept < 0.9 * apart


def test_engine_reports_fit_a_model_that_predicts_other_shares() -> None:
    """What the engine reports (`Feed.progress`), timed as the profile charges it, fits
    `EngineModel` back to the profile: it predicts the engine's time on its own share and on a
    share twice as large, where seconds per item from one share (linear) are far off."""
    lengths = PROFILE.lengths(random.Random(5), 40)
    stage, _ = _engine(lengths, [len(lengths)])
    feed = stage.feed
    assert feed.slots == PROFILE.slots
    assert sorted(n for _, _, done in feed.reports for n in done) == sorted(lengths)
    alpha, step = PROFILE.alpha, PROFILE.decode_step_s
    timed = [(n * step * (alpha + (1 - alpha) * k / PROFILE.slots), n, k) for n, k, _ in feed.reports]
    model = fit_engine(timed, lengths, feed.slots)
    assert model.step_s == pytest.approx(step * alpha)
    assert model.seq_step_s == pytest.approx(step * (1 - alpha) / PROFILE.slots)
    assert model._time(list(lengths)) == pytest.approx(PROFILE.rollout_seconds(lengths))
    doubled = PROFILE.rollout_seconds(lengths + lengths)
    assert model._time(lengths + lengths) == pytest.approx(doubled)
    linear = 2 * PROFILE.rollout_seconds(lengths)
    assert linear > 1.3 * doubled  # what a per-item rate from the first share would predict


def test_memory_bound_is_the_seeds_rule() -> None:
    assert PROFILE.max_micro_batch("rollout") == micro_batch_bound(80e9, 14e9, 0.06e9) == 330
    assert PROFILE.max_micro_batch("reward") is None  # a CPU stage: no device memory to bound


def test_profile_and_components_must_match() -> None:
    with pytest.raises(UserError, match="'embodied' has the stages \\['env', 'policy', 'actor'\\]"):
        load_config(CONFIGS / "emulated_grpo_7b.toml", ["emulation.profile=embodied"])
    with pytest.raises(UserError, match="'grpo-8b' is not a profile; choose one of grpo-7b"):
        load_config(CONFIGS / "emulated_grpo_7b.toml", ["emulation.profile=grpo-8b"])


def _emulated_args(run: Path, samples: int, *extra: str) -> list[str]:
    """A 3-step emulated 7B job on 8 ranks (4 rollout ranks, 1 actor rank)."""
    sets = [
        "components.rollout.num_ranks=4", "components.actor.num_ranks=1", "emulation.steps=3",
        f"emulation.samples_per_step={samples}", "emulation.time_scale=0.005", "pipeline.micro_batch=32",
        *extra,
    ]  # fmt: skip
    args = ["run", str(CONFIGS / "emulated_grpo_7b.toml"), "--np", "8", "--run-dir", str(run)]
    return args + [x for item in sets for x in ("--set", item)]


@pytest.mark.parametrize("continuous", [True, False], ids=["engine", "micro-batched"])
def test_emulated_job_streams_responses_and_reports_idle_and_predictions(
    tmp_path: Path, continuous: bool
) -> None:
    run = tmp_path / "run"
    engine = f"emulation.continuous_generation={str(continuous).lower()}"
    result = rlinf(*_emulated_args(run, 256, engine), timeout=240)
    assert result.returncode == 0, result.output
    assert "EMULATION (sleep-costed stages" in result.output
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["emulated"] for r in records)
    for r in records:
        assert 0 < r["idle_fraction"] < 1 and r["coordinator_busy_fraction"] < 0.5 and r["weight_sync_s"] > 0
    assert "predicted_step_s" not in records[0] and records[2]["predicted_step_s"] > 0
    spans = [json.loads(line) for line in (run / "timeline.jsonl").read_text().splitlines()]
    method = "engine" if continuous else "process"
    first_rollout = min((s for s in spans if s["name"] == f"rollout.{method}"), key=lambda s: s["start"])
    first_reward = min(s["start"] for s in spans if s["name"] == "reward.process")
    assert first_reward < first_rollout["end"]  # streamed: scored before its batch was done


def test_one_step_off_policy_generates_the_next_step_while_the_actor_trains(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = _emulated_args(run, 128, "emulation.off_policy_steps=1")
    result = rlinf(*args, timeout=240)
    assert result.returncode == 0, result.output
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_lag"] for r in records] == [0, 1, 1]
    spans = [json.loads(line) for line in (run / "timeline.jsonl").read_text().splitlines()]
    rollout, actor = (
        sorted((s for s in spans if s["name"] == f"{name}.run_stage"), key=lambda s: s["start"])
        for name in ("rollout", "actor")
    )
    rollout = [s for s in rollout if s["rank"] == rollout[0]["rank"]]  # one rollout rank's steps
    assert len(rollout) == len(actor) == 3  # the first step's generation ran before the loop
    for k in (0, 1):  # on-policy, step k+1's generation would start after step k's update
        assert rollout[k + 1]["start"] < actor[k]["end"], (rollout, actor)
    bad = rlinf(*args, "--set", "placement.mode=auto", timeout=60)
    assert bad.returncode == 2 and "runs two pipelines at once" in bad.output, bad.output
