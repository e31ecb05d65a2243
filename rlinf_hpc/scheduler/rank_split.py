"""The choice ``auto`` makes from measured phase times: how to split the worker ranks among the
stages (`split_ranks`), and collocated against that split (`predict`; one-step off-policy's two
pipelines side by side: `predict_ahead`), each predicted by `cost_model.placement_time`.

>>> from rlinf_hpc.scheduler.cost_model import PhaseProfile
>>> gen = PhaseProfile("gen", 0.03, switch_seconds=0.2)
>>> train = PhaseProfile("train", 0.01, switch_seconds=0.2)
>>> predict([gen, train], 64, 8, 4)  # collocated: 64 x 0.04 / 4 + two switches
Prediction(collocated=1.04, disaggregated=0.88, ranks_per_phase={'gen': 3, 'train': 1})
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlinf_hpc.scheduler.contention import SharedCores, contended
from rlinf_hpc.scheduler.cost_model import PhaseProfile, collocated_time, placement_time

#: How much faster the split must be predicted than collocated for ``auto`` to move the ranks.
#: Collocated's step is the warm-up's, measured; the split's is a prediction, and the first steps
#: after a move measured 1-14% above it on emulated profiles (CPU ranks: far more). Within this
#: margin the choice flipped between runs of one job (0.503 vs 0.493 s predicted, then 0.53 s
#: collocated against 0.68 for the split), so it stays where it was measured.
MOVE_MARGIN = 0.05


@dataclass(frozen=True)
class Prediction:
    """Predicted step time of each placement, and the choice (the split only if it is predicted
    `MOVE_MARGIN` faster).

    >>> Prediction(1.0, 0.97).choice, Prediction(1.0, 0.94).choice
    ('collocated', 'disaggregated')
    """

    collocated: float
    disaggregated: float
    ranks_per_phase: dict[str, int] = field(default_factory=dict)

    @property
    def choice(self) -> str:
        return "disaggregated" if self.disaggregated < (1 - MOVE_MARGIN) * self.collocated else "collocated"


def split_ranks(
    profiles: list[PhaseProfile],
    num_ranks: int,
    num_items: int | None = None,
    micro_batch: int | None = None,
) -> dict[str, int]:
    """Give each phase ranks in proportion to its work (at least one each): one rank each,
    then every further rank to the phase that is slowest per rank — the split whose bottleneck
    is smallest (rounding shares down first once left a 2-rank phase 1 rank, doubling the step).

    With an engine among the phases (its time is not proportional to its share) and
    ``num_items``/``micro_batch`` given, ranks go where they shorten the predicted step
    (`placement_time`) most per rank instead, looking past plateaus (an engine gains nothing
    from a rank until its requests fit in one wave fewer) and past its longest response, where
    an engine gains nothing at all; ranks that shorten nothing are given out as above. (The
    trials leave out contention for cores: the split found is then predicted with it, by the
    callers. At 32 emulated ranks, a contention fixed point per trial took the coordinator
    5.7 s per decision.)

    >>> split_ranks([PhaseProfile("gen", 2.75), PhaseProfile("train", 0.45)], 15)
    {'gen': 13, 'train': 2}
    """
    if num_ranks < len(profiles):
        raise ValueError(f"{len(profiles)} phases cannot run disaggregated on {num_ranks} ranks")
    work = {p.name: p.seconds_per_item + p.finish_per_item for p in profiles}
    shares = dict.fromkeys(work, 1)
    if num_items is not None and micro_batch is not None and any(p.engine for p in profiles):
        now = _split_time(profiles, shares, num_items, micro_batch)
        while sum(shares.values()) < num_ranks:
            left, best = num_ranks - sum(shares.values()), None
            for name in shares:
                for extra in range(1, left + 1):
                    trial = {**shares, name: shares[name] + extra}
                    time = _split_time(profiles, trial, num_items, micro_batch)
                    gain = (now - time) / extra
                    if gain > 1e-9 * now and (best is None or gain > best[0]):
                        best = (gain, name, extra, time)
            if best is None:
                break
            shares[best[1]] += best[2]
            now = best[3]
    while sum(shares.values()) < num_ranks:  # each rank where it shortens the bottleneck
        slowest = max(shares, key=lambda n: work[n] / shares[n])
        shares[slowest] += 1
    return shares


def _split_time(
    profiles: list[PhaseProfile],
    shares: dict[str, int],
    num_items: int,
    micro_batch: int,
    cores: SharedCores | None = None,
) -> float:
    sets = _disjoint_sets(profiles, shares)
    return contended(
        profiles, sets, num_items, cores, lambda ps: placement_time(ps, num_items, micro_batch, sets)
    )


def _disjoint_sets(profiles: list[PhaseProfile], shares: dict[str, int], first: int = 0) -> list[set[int]]:
    """Rank sets of the shares' sizes, one after the other (from rank index ``first``), in the
    profiles' order."""
    sets = []
    for p in profiles:
        sets.append(set(range(first, first + shares[p.name])))
        first += shares[p.name]
    return sets


def predict(
    profiles: list[PhaseProfile],
    num_items: int,
    micro_batch: int,
    num_ranks: int,
    measured_collocated: float | None = None,
    cores: SharedCores | None = None,
) -> Prediction:
    """Collocated vs disaggregated step time for ``num_items`` items on ``num_ranks`` ranks
    (``cores``: where CPU ranks share cores, each placement with its own contention).

    ``measured_collocated``: the step time a collocated warm-up measured. What it took beyond
    the model (the runtime's own cost: a call and its reply per stage and rank, switch-ins,
    the coordinator's fan-out) is charged per stage call, so collocated is predicted as measured
    and disaggregated — one call per rank instead of one per stage on every rank — pays its
    share (at 32 emulated ranks: 0.23 s of a 1.6 s collocated step over 4 stages).

    >>> a, b = PhaseProfile("a", 0.01), PhaseProfile("b", 0.01)
    >>> predict([a, b], 100, 10, 4).collocated, predict([a, b], 100, 10, 4).disaggregated
    (0.5, 0.6)
    >>> p = predict([a, b], 100, 10, 4, measured_collocated=0.9)  # 0.4 s over, 2 stages
    >>> round(p.collocated, 3), round(p.disaggregated, 3)
    (0.9, 0.8)
    """
    if num_items < 1 or micro_batch < 1:
        raise ValueError("num_items and micro_batch must be >= 1")
    together = _collocated_time(profiles, num_items, micro_batch, num_ranks, cores)
    if num_ranks < len(profiles):
        return Prediction(max(together, measured_collocated or 0.0), math.inf, {})
    ranks = split_ranks(profiles, num_ranks, num_items, micro_batch)
    apart = _split_time(profiles, ranks, num_items, micro_batch, cores)
    if measured_collocated is not None and measured_collocated > together:
        # per rank: one call per stage collocated, one call disaggregated
        together, apart = measured_collocated, apart + (measured_collocated - together) / len(profiles)
    return Prediction(together, apart, ranks)


def _collocated_time(
    profiles: list[PhaseProfile],
    num_items: int,
    micro_batch: int,
    num_ranks: int,
    cores: SharedCores | None = None,
) -> float:
    """Every phase on every rank over the whole batch, one after the other."""
    micro_batches = math.ceil(num_items / micro_batch)

    def time(stages: list[PhaseProfile]) -> float:
        phases = [
            p.share_seconds(num_items, num_ranks)
            + math.ceil(micro_batches / num_ranks) * p.overhead_per_micro_batch
            for p in stages
        ]
        return (
            stages[0].start_seconds
            + collocated_time(phases, [p.switch_seconds for p in stages])
            + stages[-1].finish_at(num_items, num_ranks)
        )

    return contended(profiles, [set(range(num_ranks))] * len(profiles), num_items, cores, time)


def predict_ahead(
    generation: list[PhaseProfile],
    training: list[PhaseProfile],
    num_items: tuple[int, int],
    micro_batch: int,
    num_ranks: int,
    measured_collocated: float | None = None,
    cores: SharedCores | None = None,
) -> Prediction:
    """Collocated vs disaggregated step time of one-step off-policy RL: the generation
    pipeline (``num_items[0]`` items of step t+1) and the training pipeline (``num_items[1]``
    samples of step t) start together and the step ends with the longer of the two.

    Collocated, every stage of both runs on every rank, the two pipelines taking turns: their
    work adds up. Disaggregated, the ranks are split between the pipelines and each pipeline's
    share among its stages as `predict` splits one pipeline (`split_ranks`), at the split whose
    longer pipeline is shortest — not the on-policy split: there the trainer's ranks are sized
    to keep pace with the stream of responses, here to end when generation ends.
    ``measured_collocated``: the warm-up's step, charged as in `predict`.

    >>> gen = [PhaseProfile("gen", 0.04, switch_seconds=0.1)]
    >>> train = [PhaseProfile("train", 0.02, switch_seconds=0.1, finish_seconds=0.1)]
    >>> p = predict_ahead(gen, train, (60, 60), 6, 6)  # 0.4 + 0.3 + switches; max(0.6, 0.7)
    >>> round(p.collocated, 3), round(p.disaggregated, 3), p.ranks_per_phase
    (0.9, 0.7, {'gen': 4, 'train': 2})
    """
    if min(num_items) < 1 or micro_batch < 1:
        raise ValueError("num_items and micro_batch must be >= 1")
    together = sum(
        predict(profiles, items, micro_batch, num_ranks, cores=cores).collocated
        for profiles, items in zip((generation, training), num_items, strict=True)
    )
    times: dict[int, tuple[float, float, dict[str, int]]] = {}

    def split(ranks: int) -> tuple[float, float, dict[str, int]]:
        """Generation's and training's time with ``ranks`` ranks generating, and the shares."""
        if ranks not in times:
            shares, spans = {}, []
            for profiles, items, count in zip(
                (generation, training), num_items, (ranks, num_ranks - ranks), strict=True
            ):
                own = split_ranks(profiles, count, items, micro_batch)
                spans.append(_split_time(profiles, own, items, micro_batch))
                shares.update(own)
            times[ranks] = (spans[0], spans[1], shares)
        return times[ranks]

    # generation's time falls as it gets ranks and training's rises: bisect for where they
    # cross (a linear scan costs O(ranks^3) placement models, 1.3 s at 64 ranks), then look
    # about it (a plateau of an engine's waves is not strictly monotone)
    low, high = len(generation), num_ranks - len(training)
    if low > high:
        return Prediction(together, math.inf, {})
    while low < high:
        middle = (low + high) // 2
        gen_s, train_s, _ = split(middle)
        if gen_s <= train_s:
            high = middle
        else:
            low = middle + 1
    near = range(max(len(generation), low - 2), min(num_ranks - len(training), low + 2) + 1)

    def side_by_side(ranks: int) -> float:
        """The split's step: the longer pipeline, both contending for cores with ``cores``."""
        shares = split(ranks)[2]
        if cores is None:
            return max(split(ranks)[:2])
        sets = _disjoint_sets(generation, shares) + _disjoint_sets(training, shares, ranks)
        cut = len(generation)

        def time(stages: list[PhaseProfile]) -> float:
            return max(
                placement_time(stages[:cut], num_items[0], micro_batch, sets[:cut]),
                placement_time(stages[cut:], num_items[1], micro_batch, sets[cut:]),
            )

        counts = [num_items[0]] * cut + [num_items[1]] * len(training)
        return contended(generation + training, sets, counts, cores, time)

    best = min(near, key=side_by_side)
    apart, shares = side_by_side(best), split(best)[2]
    stages = len(generation) + len(training)
    if measured_collocated is not None and measured_collocated > together:
        together, apart = measured_collocated, apart + (measured_collocated - together) / stages
    return Prediction(together, apart, shares)
