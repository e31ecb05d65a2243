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
    """Give each phase ranks in proportion to its work (at least one each)."""
    if num_ranks < len(profiles):
        raise ValueError(f"{len(profiles)} phases cannot run disaggregated on {num_ranks} ranks")
    work = {p.name: p.seconds_per_item for p in profiles}
    total = sum(work.values()) or 1.0
    shares = {n: max(1, math.floor(num_ranks * w / total)) for n, w in work.items()}
    while sum(shares.values()) > num_ranks:  # rounding up to 1 overshot: take from the largest
        largest = max(shares, key=lambda n: shares[n])
        shares[largest] -= 1
    while sum(shares.values()) < num_ranks:  # hand out the rest where it shortens the bottleneck
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
