"""Step-time models for the placements, and the choice ``auto`` makes from measured phase times.

Pipelined (disaggregated) placement, after the seed: with ``M = ceil(N / k)`` micro-batches of
``k`` items flowing through stages whose per-micro-batch times are ``t_1..t_s`` (bottleneck
``t_b = max t_j``)::

    T_total = T_warmup + ceil(N/k - 1) * T_bottleneck + T_cooldown
            = sum_j t_j + (M - 1) * t_b

(``T_warmup``/``T_cooldown``: the stages before/after the bottleneck plus the bottleneck once.)

Collocated placement: every phase runs on all ranks one after another, plus a context switch
between consecutive phases::

    T_total = sum_j T_j(all ranks) + sum of switch times

>>> pipeline_time([1.0, 3.0, 1.0], num_micro_batches=4)
14.0
>>> collocated_time([4.0, 12.0], switch_times=[0.3, 0.3])
16.6

`placement_time` predicts any placement from the ranks each stage has: stages on shared ranks
form one pipeline stage (they take turns, paying their switches), disjoint rank sets pipeline:

>>> a, b = PhaseProfile("a", 0.01), PhaseProfile("b", 0.03, switch_seconds=0.1)
>>> placement_time([a, b], 64, 16, [{1, 2}, {1, 2}])  # collocated: 64 x 0.04 / 2 + switch
1.38
>>> placement_time([a, b], 64, 16, [{1}, {2}])  # 0.16 + 0.48 + 3 x 0.48
2.08
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def pipeline_time(stage_times: list[float], num_micro_batches: int) -> float:
    """Step time of a pipeline of stages (seconds per micro-batch each) over M micro-batches."""
    if not stage_times or num_micro_batches < 1:
        raise ValueError("a pipeline needs at least one stage and one micro-batch")
    return sum(stage_times) + (num_micro_batches - 1) * max(stage_times)


def collocated_time(phase_times: list[float], switch_times: list[float] = ()) -> float:  # type: ignore[assignment]
    """Step time of phases run one after another on the same ranks, with switches between."""
    return sum(phase_times) + sum(switch_times)


@dataclass(frozen=True)
class PhaseProfile:
    """What a short warm-up measured for one phase (component)."""

    name: str
    #: Seconds to process one item on one rank.
    seconds_per_item: float
    #: Fixed cost per micro-batch on a rank (launch, transfer setup), seconds.
    overhead_per_micro_batch: float = 0.0
    #: Cost of switching this component onto the device (collocated), seconds.
    switch_seconds: float = 0.0
    #: Once per step on each of its ranks after its input ended (an optimizer step), seconds.
    finish_seconds: float = 0.0
    #: A continuous stage (an engine admitting items as it has room): seconds from its first
    #: item to its first output. None: a micro-batched stage, whose first output comes after one
    #: micro-batch.
    latency_seconds: float | None = None


@dataclass(frozen=True)
class Prediction:
    """Predicted step time of each placement, and the choice."""

    collocated: float
    disaggregated: float
    ranks_per_phase: dict[str, int] = field(default_factory=dict)

    @property
    def choice(self) -> str:
        return "collocated" if self.collocated <= self.disaggregated else "disaggregated"


def split_ranks(profiles: list[PhaseProfile], num_ranks: int) -> dict[str, int]:
    """Give each phase ranks in proportion to its work (at least one each): one rank each,
    then every further rank to the phase that is slowest per rank — the split whose bottleneck
    is smallest (rounding shares down first once left a 2-rank phase 1 rank, doubling the step).

    >>> split_ranks([PhaseProfile("gen", 2.75), PhaseProfile("train", 0.45)], 15)
    {'gen': 13, 'train': 2}
    """
    if num_ranks < len(profiles):
        raise ValueError(f"{len(profiles)} phases cannot run disaggregated on {num_ranks} ranks")
    work = {p.name: p.seconds_per_item for p in profiles}
    shares = dict.fromkeys(work, 1)
    while sum(shares.values()) < num_ranks:  # each rank where it shortens the bottleneck
        slowest = max(shares, key=lambda n: work[n] / shares[n])
        shares[slowest] += 1
    return shares


def predict(profiles: list[PhaseProfile], num_items: int, micro_batch: int, num_ranks: int) -> Prediction:
    """Collocated vs disaggregated step time for ``num_items`` items on ``num_ranks`` ranks."""
    if num_items < 1 or micro_batch < 1:
        raise ValueError("num_items and micro_batch must be >= 1")
    micro_batches = math.ceil(num_items / micro_batch)
    # collocated: each phase uses every rank on the whole batch, one micro-batch per rank share
    phases = [
        num_items * p.seconds_per_item / num_ranks
        + math.ceil(micro_batches / num_ranks) * p.overhead_per_micro_batch
        for p in profiles
    ]
    together = collocated_time(phases, [p.switch_seconds for p in profiles]) + profiles[-1].finish_seconds
    if num_ranks < len(profiles):
        return Prediction(together, math.inf, {})
    ranks = split_ranks(profiles, num_ranks)
    first, sets = 0, []
    for p in profiles:  # disjoint rank sets of the split's sizes
        sets.append(set(range(first, first + ranks[p.name])))
        first += ranks[p.name]
    apart = placement_time(profiles, num_items, micro_batch, sets)
    return Prediction(together, apart, ranks)


def placement_time(
    profiles: list[PhaseProfile],
    num_items: int,
    micro_batch: int,
    stage_ranks: list[set[int]],
) -> float:
    """Step time of the stages (in flow order) on the given ranks.

    Stages whose ranks overlap form one group, run one after the other on its ranks (paying
    their switch times); groups on disjoint ranks pipeline. A group's *work* is its whole
    share of the items; its *latency* is how long the group after it waits for its first
    output (one micro-batch, an engine's measured first output, or for a group of several
    stages everything before its last stage plus that one's latency). The step takes the
    longest of (one group's work + every other group's latency) — the seed's formula
    ``sum_j t_j + (M - 1) t_b`` when every stage is micro-batched — plus the once-per-step
    finish of the last group's stages."""
    if len(profiles) != len(stage_ranks) or not profiles:
        raise ValueError("one rank set per stage profile")
    groups: list[tuple[set[int], list[int]]] = []
    for index, ranks in enumerate(stage_ranks):
        joined = next((g for g in groups if g[0] & ranks), None)
        if joined is None:
            groups.append((set(ranks), [index]))
        else:
            joined[0].update(ranks)
            joined[1].append(index)
    micro_batches = math.ceil(num_items / micro_batch)
    works, latencies, switches = [], [], 0.0
    for ranks, members in groups:
        full, first = [], []
        for i in members:
            p = profiles[i]
            if p.latency_seconds is not None:  # an engine: its share at its rate
                full.append(num_items * p.seconds_per_item / len(ranks))
                first.append(p.latency_seconds)
            else:
                batch = (micro_batch * p.seconds_per_item + p.overhead_per_micro_batch) / len(ranks)
                full.append(micro_batches * batch)
                first.append(batch)
        works.append(sum(full))
        latencies.append(sum(full[:-1]) + first[-1])
        if len(members) > 1:
            switches += sum(profiles[i].switch_seconds for i in members)
    total = sum(latencies)
    longest = max(work + total - latency for work, latency in zip(works, latencies, strict=True))
    tail = sum(profiles[i].finish_seconds for i in groups[-1][1])
    return round(longest + switches + tail, 6)
