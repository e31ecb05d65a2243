"""Placement cost model and elastic micro-batching (pure logic, part of the M2Flow runtime)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from rlinf_hpc.scheduler.cost_model import EngineModel, PhaseProfile, pipeline_time, placement_time
from rlinf_hpc.scheduler.elastic import ElasticBatching
from rlinf_hpc.scheduler.rank_split import predict, predict_ahead, split_ranks


@pytest.mark.parametrize(
    ("stages", "items", "k"), [([1.0, 3.0, 1.0], 64, 8), ([2.0, 0.5], 10, 4), ([0.2, 0.2, 0.9, 0.1], 256, 32)]
)
def test_pipeline_time_is_the_seed_formula(stages: list[float], items: int, k: int) -> None:
    bottleneck = max(stages)
    b = stages.index(bottleneck)
    warmup = sum(stages[:b]) + bottleneck  # until the bottleneck's first micro-batch is out
    cooldown = sum(stages[b + 1 :])
    seed = warmup + math.ceil(items / k - 1) * bottleneck + cooldown
    assert pipeline_time(stages, math.ceil(items / k)) == pytest.approx(seed)


def test_an_engines_first_output_and_the_finish_set_the_pipeline_fill_and_tail() -> None:
    """A continuous stage's work is its share at its rate and the stage after it waits only
    for its first output; the last stage's finish comes once per step."""
    engine = PhaseProfile("rollout", 0.1, latency_seconds=2.0)
    actor = PhaseProfile("actor", 0.02, finish_seconds=0.5)
    # engine-bound: 100 x 0.1 / 2 = 5 s, then the actor's last micro-batch (10 x 0.02) + finish
    assert placement_time([engine, actor], 100, 10, [{1, 2}, {3}]) == pytest.approx(5.0 + 0.2 + 0.5)
    # actor-bound: it starts after the engine's first output, then does all its 2 s
    slow = PhaseProfile("actor", 0.08, finish_seconds=0.5)
    assert placement_time([engine, slow], 100, 10, [{1, 2}, {3}]) == pytest.approx(2.0 + 8.0 + 0.5)
    # collocated: one after the other on the same ranks
    assert placement_time([engine, actor], 100, 10, [{1, 2}, {1, 2}]) == pytest.approx(5.0 + 1.0 + 0.5)
    # the last micro-batch runs on one actor rank however many there are: the drain is not shared
    assert placement_time([engine, actor], 100, 10, [{1, 2}, {3, 4}]) == pytest.approx(5.0 + 0.2 + 0.5)


def test_a_modelled_engine_gets_the_ranks_it_can_use_and_no_more() -> None:
    """An engine of 64 slots whose every request takes 100 decode steps costs the same on 1 to
    64 requests: measured on 32 requests per rank, seconds per item (linear) would give it most
    ranks; modelled, it gets the 4 that hold 256 requests in one wave and the trainer the rest."""
    engine = EngineModel(step_s=0.01, seq_step_s=0.0, slots=64, lengths=(100,))
    rollout = PhaseProfile("rollout", 1.0 / 32, latency_seconds=1.0, engine=engine)
    actor = PhaseProfile("actor", 0.01)
    assert rollout.share_seconds(256, 4) == pytest.approx(1.0) == rollout.share_seconds(256, 8)
    assert rollout.share_seconds(256, 2) == pytest.approx(2.0)  # two waves
    linear = split_ranks([PhaseProfile("rollout", 1.0 / 32, latency_seconds=1.0), actor], 12)
    modelled = split_ranks([rollout, actor], 12, num_items=256, micro_batch=16)
    assert linear["rollout"] >= 8 and modelled == {"rollout": 4, "actor": 8}
    sets = [set(range(4)), set(range(4, 12))]
    assert placement_time([rollout, actor], 256, 16, sets) == pytest.approx(1.0 + 256 * 0.01 / 8)
    assert predict([rollout, actor], 256, 16, 12).ranks_per_phase == modelled


def test_a_rank_whose_engine_ends_early_feeds_the_stages_after_its_group() -> None:
    """Hybrid (an engine and a later stage on the same ranks, a trainer on its own): a rank
    whose engine is done goes on to the later stage with its own responses while the others
    still generate, so the trainer starts after the *first* engine's end — not after the last
    one's and the whole group's work (that over-predicted hybrid by ~20% at 24-32 emulated
    ranks). The group itself still ends with its slowest engine plus its own later work."""
    # four requests per engine in one slot, 10 or 100 decode steps of 0.01 s each
    engine = EngineModel(step_s=0.01, seq_step_s=0.0, slots=1, lengths=(10, 100))
    first, mean, last = engine.spread(4, engines=8)
    assert 0.4 <= first < mean < last <= 4.0
    rollout = PhaseProfile("rollout", 0.07, latency_seconds=0.1, engine=engine)
    inference = PhaseProfile("inference", 0.02)  # micro-batches of 1: 32 x 0.02 / 8 per rank
    shared = [set(range(8)), set(range(8))]
    assert placement_time([rollout, inference], 32, 1, shared) == pytest.approx(last + 0.08)
    actor = PhaseProfile("actor", 0.5)  # 32 x 0.5 / 2 = 8 s on ranks of its own
    sets = [*shared, {8, 9}]
    assert placement_time([rollout, inference, actor], 32, 1, sets) == pytest.approx(first + 0.02 + 8.0)
    # without an engine model the ranks end together: the trainer waits for the group's work
    plain = PhaseProfile("rollout", rollout.seconds_per_item, latency_seconds=0.1)
    expected = plain.share_seconds(32, 8) + 0.02 + 8.0
    assert placement_time([plain, inference, actor], 32, 1, sets) == pytest.approx(expected)
    # a stage between them on the shared ranks: the last one waits for its stream to end, which
    # is after the last engine (a rank runs a stage until its input ends)
    reward = PhaseProfile("reward", 0.01)  # 32 x 0.01 / 8 = 0.04 s per rank
    three = [*shared, set(range(8)), {8, 9}]
    expected = last + 0.04 + 0.02 + 8.0
    assert placement_time([rollout, reward, inference, actor], 32, 1, three) == pytest.approx(expected)


def test_a_trainer_after_a_shared_engine_group_gets_its_input_as_the_engines_end() -> None:
    """Hybrid again, with a trainer short next to the engines' spread: the group hands on a
    rank's responses only when that rank's engine ends, so the trainer cannot run at its own
    pace from the first end on — after the last engine's end it still has that engine's
    share to do (hybrid at 32 emulated ranks was under-predicted by 12% without this)."""
    engine = EngineModel(step_s=0.01, seq_step_s=0.0, slots=1, lengths=(10, 100))
    ends = engine.ends(4, engines=8)
    assert list(ends) == sorted(ends) and len(ends) == 8
    assert engine.spread(4, engines=8) == pytest.approx((ends[0], sum(ends) / 8, ends[-1]))
    rollout = PhaseProfile("rollout", 0.07, latency_seconds=0.1, engine=engine)
    inference = PhaseProfile("inference", 0.02)
    actor = PhaseProfile("actor", 0.0625)  # 32 x 0.0625 / 2 = 1 s on ranks of its own
    sets = [set(range(8)), set(range(8)), {8, 9}]
    predicted = placement_time([rollout, inference, actor], 32, 1, sets)
    # by the last end 1/8 of the input is still to come: 1/8 s of work after it at least
    assert predicted >= ends[-1] + 0.02 + 1.0 / 8 - 1e-9
    assert predicted > ends[0] + 0.02 + 1.0  # the old bound: at its pace from the first end
    # what the i-th end brings: the work of the last 8 - i engines' responses after it
    late = max(end - ends[0] - 1.0 * i / 8 for i, end in enumerate(ends))
    assert predicted == pytest.approx(ends[0] + 0.02 + 1.0 + late)
    # engines alike (no spread): nothing to wait for beyond the first output
    alike = PhaseProfile("rollout", 0.07, latency_seconds=0.1, engine=EngineModel(0.01, 0.0, 1, (10,)))
    assert placement_time([alike, inference, actor], 32, 1, sets) == pytest.approx(0.4 + 0.02 + 1.0)


def test_each_stage_has_its_own_micro_batch() -> None:
    """The elastic controller sizes each stage's micro-batches apart, and a fixed pipeline's
    first stage may get smaller ones (equal counts per rank): a stage's latency is one of its
    own micro-batches, not one of the mean size (the mean of 21-32 over-predicted a fixed
    pipeline at 32 emulated ranks by 12%)."""
    generate, train = PhaseProfile("generate", 0.1), PhaseProfile("train", 0.01)
    sets = [{1}, {2}]
    # generate: 16 micro-batches of 4 (0.4 s each) = 6.4 s, then train's last one of 16: 0.16 s
    assert placement_time([generate, train], 64, [4, 16], sets) == pytest.approx(6.4 + 0.16)
    assert placement_time([generate, train], 64, [10, 10], sets) == placement_time(
        [generate, train], 64, 10, sets
    )
    with pytest.raises(ValueError, match="one micro-batch size >= 1 per stage"):
        placement_time([generate, train], 64, [4], sets)


def test_the_last_item_takes_as_long_through_a_stage_as_its_last_micro_batch_did() -> None:
    """A long-tailed stream's last items are its longest responses, so the last micro-batch of
    a stage after the generator costs more than one of the mean (a fixed pipeline at 24
    emulated ranks: 0.14 s against 0.056; -14% without this). A stage's measured drain counts
    where the step waits for the last item to get through it — after the stages before it —
    and not where its own work is the long pole."""
    generate, train = PhaseProfile("generate", 0.1), PhaseProfile("train", 0.01)
    slow_tail = PhaseProfile("train", 0.01, drain_seconds=0.5)
    sets = [{1}, {2}]
    # generate-bound: 16 micro-batches of 4 (6.4 s), then the last one through train
    assert placement_time([generate, train], 64, 4, sets) == pytest.approx(6.4 + 0.04)
    assert placement_time([generate, slow_tail], 64, 4, sets) == pytest.approx(6.4 + 0.5)
    # a drain shorter than a micro-batch of the mean changes nothing (a small last one)
    short = PhaseProfile("train", 0.01, drain_seconds=0.01)
    assert placement_time([generate, short], 64, 4, sets) == placement_time([generate, train], 64, 4, sets)
    # train-bound: it waits for generate's first micro-batch, then does its work
    heavy = PhaseProfile("train", 0.5, drain_seconds=3.0)
    assert placement_time([generate, heavy], 64, 4, sets) == pytest.approx(0.4 + 32.0)


def test_a_drain_measured_on_a_whole_share_does_not_stretch_a_pipeline_of_small_micro_batches() -> None:
    """``auto`` measures its warm-up collocated, where a stage's last micro-batch is a rank's
    whole share (23 items, 0.62 s of training at 24 emulated ranks, a profile not ours), and
    predicts disaggregated with micro-batches of 4: taken as the last item's way through the
    trainer, those 0.62 s made every split look 0.3 s slower, and auto stayed collocated at
    1.20 s while the hand split ran 1.01 s (``auto_vs_best`` 0.85). Measured on more items
    than the prediction's micro-batch, the drain counts per item."""
    generate, train = PhaseProfile("generate", 0.1), PhaseProfile("train", 0.027)
    whole_share = PhaseProfile("train", 0.027, drain_seconds=0.62, drain_items=23)
    sets = [{1}, {2}]
    plain = placement_time([generate, train], 64, 4, sets)
    assert placement_time([generate, whole_share], 64, 4, sets) == pytest.approx(plain)
    # measured on micro-batches as small as the prediction's, the drain counts whole
    tail = PhaseProfile("train", 0.027, drain_seconds=0.62, drain_items=4)
    assert placement_time([generate, tail], 64, 4, sets) == pytest.approx(6.4 + 0.62)


def test_the_feed_before_the_first_stage_delays_the_whole_step() -> None:
    """A first stage that waits for full micro-batches waits for the coordinator's feed first
    (0.2-0.6 s at 32 emulated ranks with micro-batches of 32); every path through the step
    starts after it, in any placement."""
    generate = PhaseProfile("generate", 0.01)
    fed = PhaseProfile("generate", 0.01, start_seconds=0.4)
    train = PhaseProfile("train", 0.02)
    for sets in ([{1}, {2}], [{1, 2}, {1, 2}]):
        plain = placement_time([generate, train], 64, 16, sets)
        assert placement_time([fed, train], 64, 16, sets) == pytest.approx(plain + 0.4)
    assert predict([fed, train], 64, 16, 2).collocated == pytest.approx(
        predict([generate, train], 64, 16, 2).collocated + 0.4
    )


def test_an_engine_model_is_calibrated_to_the_engine_time_measured() -> None:
    """The decode-step fit leaves out what happens around the decode steps (requests arriving
    over time, the host's delays): calibrated, the model's mean engine time on the measured
    shares is the measured one, and other shares scale alike (bounded: a bad step cannot make
    the model absurd)."""
    engine = EngineModel(step_s=0.01, seq_step_s=0.001, slots=4, lengths=(100,))
    assert engine.seconds(4, engines=2) == pytest.approx(1.4)
    slower = engine.calibrated([1.54, 1.54], [4, 4])
    assert slower.calibration == pytest.approx(1.1)
    assert slower.seconds(8, engines=1) == pytest.approx(2.8 * 1.1)  # two waves, scaled
    assert slower.calibrated([1.54, 1.54], [4, 4]).calibration == pytest.approx(1.1)  # idempotent
    assert engine.calibrated([10.0], [4]).calibration == pytest.approx(1.5)  # bounded
    assert engine.calibrated([], []) is engine


def test_an_engine_calibration_compares_each_engine_with_its_own_responses() -> None:
    """One step's engines are one draw of where the long responses fell: compared with the
    model's expected share they would move the calibration, compared with their own responses
    they do not (the emulated engine is exact: calibration 1). The lengths an engine reports
    come in the order they finished; the model's time on them takes them in a random order, as
    it draws its shares, not with the longest last (a second wave of long ones)."""
    engine = EngineModel(step_s=0.01, seq_step_s=0.0, slots=1, lengths=(10, 10, 10, 100))
    assert engine.spread(1, engines=2)[1] < 0.4  # its expected share: mostly short ones
    lucky = [1.0, 0.1]  # one engine got the long response, the other a short one
    assert engine.calibrated(lucky, [1, 1]).calibration == pytest.approx(1.5)  # drawn: bounded
    assert engine.calibrated(lucky, [1, 1], shares=[[100], [10]]).calibration == pytest.approx(1.0)
    waves = EngineModel(step_s=0.01, seq_step_s=0.0, slots=3, lengths=(10, 10, 10, 100))
    finished = [[10, 10, 10, 100]]  # as reported: shortest first; in that order the long one
    assert waves._time(finished[0], []) == pytest.approx(1.1)  # would wait for a slot
    assert waves._share_time(finished[0]) == pytest.approx(waves._share_time([100, 10, 10, 10]))
    assert 1.0 <= waves._share_time(finished[0]) < 1.1  # mostly in the first wave
    took = waves._share_time(finished[0])
    assert waves.calibrated([took], [4], finished).calibration == pytest.approx(1.0)
    partial = replace(waves, stop_fraction=0.25)  # a partial engine's carry-in: its drawn share
    assert partial.calibrated([1.0], [4], finished) == partial.calibrated([1.0], [4])


def test_split_ranks_follows_work_and_uses_every_rank() -> None:
    profiles = [PhaseProfile("rollout", 3.0), PhaseProfile("inference", 1.0), PhaseProfile("actor", 2.0)]
    shares = split_ranks(profiles, 12)
    assert shares == {"rollout": 6, "inference": 2, "actor": 4}
    assert sum(split_ranks(profiles, 4).values()) == 4
    assert min(split_ranks(profiles, 3).values()) == 1
    with pytest.raises(ValueError, match="3 phases cannot run disaggregated on 2 ranks"):
        split_ranks(profiles, 2)


def test_auto_prefers_pipelining_when_switches_are_expensive() -> None:
    # balanced phases, costly context switches (large models offloaded every step)
    profiles = [
        PhaseProfile("rollout", 0.01, switch_seconds=2.0),
        PhaseProfile("actor", 0.01, switch_seconds=2.0),
    ]
    prediction = predict(profiles, num_items=512, micro_batch=32, num_ranks=4)
    assert prediction.choice == "disaggregated"
    assert prediction.disaggregated < prediction.collocated


def test_auto_prefers_collocation_when_stages_are_lopsided_and_switches_cheap() -> None:
    # one phase dominates: a pipeline would leave the other stage's ranks idle in bubbles
    profiles = [
        PhaseProfile("rollout", 0.05, overhead_per_micro_batch=0.2, switch_seconds=0.01),
        PhaseProfile("actor", 0.001, overhead_per_micro_batch=0.2, switch_seconds=0.01),
    ]
    prediction = predict(profiles, num_items=256, micro_batch=8, num_ranks=2)
    assert prediction.choice == "collocated"
    assert prediction.collocated < prediction.disaggregated


def test_elastic_batching_moves_in_the_right_direction_and_stays_in_bounds() -> None:
    batching = ElasticBatching(minimum=8, maximum=128, size=64, wait_threshold_s=0.05)
    sizes = [batching.update(downstream_wait_s=1.0, memory_fraction=0.1)[0] for _ in range(6)]
    assert sizes == [32, 16, 8, 8, 8, 8]  # latency: shrink, never below the minimum
    sizes = [batching.update(downstream_wait_s=0.0, memory_fraction=0.99)[0] for _ in range(6)]
    assert sizes == [16, 32, 64, 128, 128, 128]  # memory pressure: grow, never above the maximum
    assert len(batching.history) == 7 and all(reason for _, _, reason in batching.history)
    assert batching.update(0.0, 0.5) == (128, None)


def test_elastic_batching_rejects_min_above_max() -> None:
    with pytest.raises(ValueError, match=r"minimum \(64\) must be >= 1 and <= maximum \(32\)"):
        ElasticBatching(minimum=64, maximum=32)


def test_shrunken_micro_batch_grows_back_once_downstream_keeps_up() -> None:
    from rlinf_hpc.scheduler.elastic import ElasticBatching

    batching = ElasticBatching(minimum=4, maximum=64, size=8, wait_threshold_s=0.1, patience=3, start=32)
    assert batching.start == 32
    sizes = [batching.update(0.0, 0.1)[0] for _ in range(3)]
    assert sizes == [8, 8, 16]  # a carried-over small size grows toward the configured start
    assert batching.update(0.05, 0.1) == (16, None)  # waiting, but under the threshold: no change
    assert [batching.update(0.05, 0.1)[0] for _ in range(5)] == [16] * 5  # not calm (> 0.1 / 4)
    assert [batching.update(0.0, 0.1)[0] for _ in range(6)] == [16, 16, 32, 32, 32, 32]  # never above start
    assert batching.update(0.5, 0.1)[0] == 16
    assert "grow back to 32" in batching.history[-2][2]


def test_only_a_stage_found_batch_bound_waits_for_full_micro_batches() -> None:
    """A last stage trying a larger size (nothing downstream waits) takes what has arrived:
    waiting for a full trial batch made one of three actor ranks sharing a stream hold its
    items to the end of the stream. A stage whose smaller batches cost more does wait."""
    last = ElasticBatching(minimum=4, maximum=512, size=32, wait_threshold_s=0.05, patience=2)
    for _ in range(2):
        last.update(0.0, 0.1, items=32, seconds=0.32, downstream_apart=False)
    assert last.size == 64 and "try 64" in last.history[-1][2]
    assert not last.batch_bound
    bound = ElasticBatching(minimum=8, maximum=128, size=32, wait_threshold_s=0.05, patience=2)
    bound.update(0.2, 0.3, items=32, seconds=1.0)  # halve to 16, on probation
    for _ in range(2):
        bound.update(0.2, 0.3, items=16, seconds=1.0)  # twice the per-item cost: back, floor 32
    assert bound.size == 32 and bound.batch_bound


class _EngineEnds:
    """An engine model whose engines end at fixed times (whatever their share)."""

    def __init__(self, ends: list[float]) -> None:
        self._ends = tuple(ends)

    def ends(self, per_engine: float, engines: int) -> tuple[float, ...]:
        return self._ends

    def spread(self, per_engine: float, engines: int) -> tuple[float, float, float]:
        return (self._ends[0], sum(self._ends) / len(self._ends), self._ends[-1])


def test_a_stage_fed_from_other_ranks_after_an_engine_pools_the_ranks_free_time() -> None:
    """Hybrid with the trainer on the engines' ranks and the reward apart (a profile not ours,
    24 emulated ranks): the trainer's input comes from the reward's rank, balanced over the
    ranks by what each has taken, so ranks whose engines ended early train more while the last
    engine still generates. Predicted as each rank's engine then an even share of training,
    the step came out 13% long (1.64 s against 1.45); pooled, 3%."""
    generate = PhaseProfile("rollout", 0.0, latency_seconds=0.1, engine=_EngineEnds([0.5, 0.5, 0.5, 1.5]))
    reward, train = PhaseProfile("reward", 0.001), PhaseProfile("actor", 0.01)
    sets = [{1, 2, 3, 4}, {5}, {1, 2, 3, 4}]
    # 25 micro-batches of 4 (1.0 s of training): the three early ranks take it while the last
    # engine runs; the step ends with that engine, its last micro-batch and the reward's
    assert placement_time([generate, reward, train], 100, 4, sets) == pytest.approx(1.5 + 0.04 + 0.004)
    # 4.0 s of training: the ranks' free time pooled, (3 x 0.5 + 1.5 + 4.0) / 4
    assert placement_time([generate, reward, train], 400, 4, sets) == pytest.approx(1.75 + 0.004)
    # fed from its own ranks (collocated: local), each rank trains on its own responses
    local = [{1, 2, 3, 4}] * 3
    assert placement_time([generate, reward, train], 100, 4, local) > 1.5 + 0.25


def test_off_policy_auto_splits_the_ranks_so_the_longer_pipeline_is_shortest() -> None:
    """One-step off-policy: generation and training run at the same time, so the best split
    is the one whose longer pipeline is shortest — checked against every split by brute force.
    The on-policy split (its trainer sized to keep pace with the stream of responses) is not
    it: here it leaves the trainer the long pole, 17% longer."""
    engine = EngineModel(step_s=0.01, seq_step_s=0.0, slots=16, lengths=(10, 20, 40))
    rollout = PhaseProfile("rollout", 0.025, latency_seconds=0.1, engine=engine)
    reward, actor = PhaseProfile("reward", 0.002), PhaseProfile("actor", 0.02, finish_seconds=0.1)
    items, micro_batch, ranks = 256, 8, 16
    ahead = predict_ahead([rollout, reward], [actor], (items, items), micro_batch, ranks)

    def apart(shares: tuple[int, int, int]) -> float:
        gen = [set(range(shares[0])), set(range(100, 100 + shares[1]))]
        train = [set(range(shares[2]))]
        return max(
            placement_time([rollout, reward], items, micro_batch, gen),
            placement_time([actor], items, micro_batch, train),
        )

    every = [(g, r, ranks - g - r) for g in range(1, ranks - 1) for r in range(1, ranks - g)]
    best = min(apart(shares) for shares in every)
    assert ahead.disaggregated == pytest.approx(best)
    chosen = tuple(ahead.ranks_per_phase[name] for name in ("rollout", "reward", "actor"))
    assert sum(chosen) == ranks and apart(chosen) == pytest.approx(best)
    on_policy = predict([rollout, reward, actor], items, micro_batch, ranks).ranks_per_phase
    assert apart(tuple(on_policy[name] for name in ("rollout", "reward", "actor"))) > 1.1 * best
    # collocated: the two pipelines take turns on every rank, their work adds up
    assert ahead.collocated == pytest.approx(
        predict([rollout, reward], items, micro_batch, ranks).collocated
        + predict([actor], items, micro_batch, ranks).collocated
    )
    with pytest.raises(ValueError):
        predict_ahead([rollout, reward], [actor], (0, items), micro_batch, ranks)


def test_a_stage_started_at_the_minimum_tries_a_larger_size_once_while_downstream_waits() -> None:
    """Started at the smallest size (`auto` after a move), a stage never halved into it and so
    never learnt whether small micro-batches cost it more: with downstream waiting it tries the
    next size once, keeps it if cheaper per item (a CPU rollout: 2 prompts 1.8x costlier than
    4), and goes back for good if not."""
    costly = ElasticBatching(minimum=2, maximum=32, size=2, wait_threshold_s=0.05, patience=1)
    costly.adopt({})
    assert costly.update(1.0, 0.1, items=2, seconds=0.2)[0] == 4  # 0.1 s per item at 2: try 4
    assert costly.update(1.0, 0.1, items=4, seconds=0.22)[0] == 4  # 0.055 at 4: kept
    assert costly._k["floor"] == 4
    assert "smallest size: try 4 once" in costly.history[0][2]
    linear = ElasticBatching(minimum=2, maximum=32, size=2, wait_threshold_s=0.05, patience=1)
    linear.adopt({})
    assert linear.update(1.0, 0.1, items=2, seconds=0.2)[0] == 4
    assert linear.update(1.0, 0.1, items=4, seconds=0.4)[0] == 2  # no cheaper: back, no larger
    assert [linear.update(1.0, 0.1, items=2, seconds=0.2)[0] for _ in range(4)] == [2] * 4
