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
    together = collocated_time(phases, [p.switch_seconds for p in profiles])
    if num_ranks < len(profiles):
        return Prediction(together, math.inf, {})
    ranks = split_ranks(profiles, num_ranks)
    stages = [
        (micro_batch * p.seconds_per_item + p.overhead_per_micro_batch) / ranks[p.name] for p in profiles
    ]
    apart = pipeline_time(stages, micro_batches)
    return Prediction(together, apart, ranks)


def placement_time(
    profiles: list[PhaseProfile],
    num_items: int,
    micro_batch: int,
    stage_ranks: list[set[int]],
    finish_seconds: list[float] | None = None,
) -> float:
    """Step time of the stages (in flow order) on the given ranks. Stages whose ranks overlap
    are one pipeline stage, run one after the other (with their switch times); ``finish_seconds``
    (a stage's once-per-step tail, e.g. an optimizer step) adds for the stages of the last one."""
    if len(profiles) != len(stage_ranks) or not profiles:
        raise ValueError("one rank set per stage profile")
    finish_seconds = finish_seconds or [0.0] * len(profiles)
    groups: list[tuple[set[int], list[int]]] = []
    for index, ranks in enumerate(stage_ranks):
        joined = next((g for g in groups if g[0] & ranks), None)
        if joined is None:
            groups.append((set(ranks), [index]))
        else:
            joined[0].update(ranks)
            joined[1].append(index)
    times, switches = [], 0.0
    for ranks, members in groups:
        work = sum(
            micro_batch * profiles[i].seconds_per_item + profiles[i].overhead_per_micro_batch for i in members
        )
        times.append(work / len(ranks))
        if len(members) > 1:
            switches += sum(profiles[i].switch_seconds for i in members)
    tail = sum(finish_seconds[i] for i in groups[-1][1])
    return round(pipeline_time(times, math.ceil(num_items / micro_batch)) + switches + tail, 6)
