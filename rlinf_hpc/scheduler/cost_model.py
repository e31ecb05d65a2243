"""Step-time models for the placements, from measured phase times (`rank_split` makes ``auto``'s
choice with them).

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
from collections.abc import Sequence
from dataclasses import dataclass, replace

from rlinf_hpc.scheduler.engine_model import EngineModel


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
    #: A continuous stage whose engine reported its steps (`Feed.progress`): its time on a
    #: share comes from this model instead of ``seconds_per_item`` (which stays its mean).
    engine: EngineModel | None = None
    #: The flow's first stage only: how long its first rank waited for its first micro-batch
    #: (the coordinator's feed; fixed micro-batches of 32 on 24 ranks: 0.2-0.6 s at 32 emulated
    #: ranks), before anything of the step can start.
    start_seconds: float = 0.0
    #: A micro-batched stage: the longest its last micro-batch of the step took on a rank. The
    #: last items of a long-tailed stream are its longest responses, so the step's last item
    #: may take longer through the stage than a micro-batch of the mean (0: not measured). On
    #: ranks apart from its upstream, how long after the upstream's last output it ended, if
    #: longer: the heavy last items queue there (`profiles.profiles_from_step`).
    drain_seconds: float = 0.0
    #: The items of that micro-batch (0: not known). Predicted at smaller micro-batches, the
    #: drain shrinks in proportion: a collocated warm-up's last micro-batch is a rank's whole
    #: share, and its time is not how long the last item takes through micro-batches of 4.
    drain_items: int = 0

    #: A micro-batched stage whose method streams its outputs (a static batch handing over
    #: the responses that finished while the rest still decode): seconds from a micro-batch's
    #: start to its first output (0: not streamed, its first output is the whole micro-batch).
    first_output_seconds: float = 0.0

    #: A finish whose work grows with the rank's share (an update over the step's samples):
    #: seconds per item of the share, on top of ``finish_seconds`` (`finish_at`).
    finish_per_item: float = 0.0

    #: CPU ranks: the share of the stage's busy time (of its finish) that is work on a core, the
    #: times above being a rank's alone (`contention`: what its neighbours add). 0: none
    #: measured, or a device's work (an emulated device's sleep).
    cpu_fraction: float = 0.0
    finish_cpu_fraction: float = 0.0

    def stretched(self, factor: float) -> PhaseProfile:
        """This phase with its CPU work ``factor`` times as long (ranks sharing cores).

        >>> PhaseProfile("a", 0.02, cpu_fraction=0.5, finish_seconds=0.1).stretched(2.0).seconds_per_item
        0.03
        """
        if factor == 1.0 or not (self.cpu_fraction or self.finish_cpu_fraction):
            return self
        busy, finish = 1 + self.cpu_fraction * (factor - 1), 1 + self.finish_cpu_fraction * (factor - 1)
        engine = self.engine
        if engine is not None:
            engine = replace(engine, calibration=engine.calibration * busy)
        return replace(
            self,
            seconds_per_item=self.seconds_per_item * busy,
            overhead_per_micro_batch=self.overhead_per_micro_batch * busy,
            latency_seconds=None if self.latency_seconds is None else self.latency_seconds * busy,
            engine=engine,
            drain_seconds=self.drain_seconds * busy,
            first_output_seconds=self.first_output_seconds * busy,
            finish_seconds=self.finish_seconds * finish,
            finish_per_item=self.finish_per_item * finish,
        )

    def cpu_seconds(self, num_items: float, ranks: int) -> float:
        """Seconds on a core each of ``ranks`` ranks spends on its share (alone).

        >>> p = PhaseProfile("a", 0.02, cpu_fraction=0.5, finish_seconds=0.1, finish_cpu_fraction=1.0)
        >>> p.cpu_seconds(10, 2)  # half of 0.1 s of work, and the whole finish
        0.15
        """
        busy = self.share_spread(num_items, ranks)[1] if self.cpu_fraction else 0.0
        finish = self.finish_at(num_items, ranks) if self.finish_cpu_fraction else 0.0
        return round(self.cpu_fraction * busy + self.finish_cpu_fraction * finish, 9)

    def finish_at(self, num_items: float, ranks: int) -> float:
        """Each rank's finish when ``ranks`` ranks share ``num_items`` items.

        >>> PhaseProfile("actor", 0.0, finish_seconds=0.1, finish_per_item=0.01).finish_at(100, 4)
        0.35
        """
        return round(self.finish_seconds + self.finish_per_item * num_items / ranks, 9)

    def drain_at(self, micro_batch: int) -> float:
        """The drain at micro-batches of ``micro_batch`` items (`drain_seconds`, scaled down
        when it was measured on a larger micro-batch).

        >>> PhaseProfile("train", 0.03, drain_seconds=0.6, drain_items=20).drain_at(4)
        0.12
        >>> PhaseProfile("train", 0.03, drain_seconds=0.6, drain_items=20).drain_at(32)
        0.6
        """
        if 0 < micro_batch < self.drain_items:
            return round(self.drain_seconds * micro_batch / self.drain_items, 9)
        return self.drain_seconds

    def share_seconds(self, num_items: float, ranks: int) -> float:
        """Time of this phase's whole share on ``ranks`` ranks (its slowest one, for an engine)."""
        return self.share_spread(num_items, ranks)[2]

    def share_spread(self, num_items: float, ranks: int) -> tuple[float, float, float]:
        """When the first, the mean and the last of ``ranks`` ranks end their share (alike
        unless an engine model says how a share's time varies with its responses)."""
        if self.engine is not None:
            return self.engine.spread(num_items / ranks, ranks)
        even = num_items * self.seconds_per_item / ranks
        return (even, even, even)

    def share_ends(self, num_items: float, ranks: int) -> tuple[float, ...]:
        """When each of ``ranks`` ranks ends its share, earliest first."""
        if self.engine is not None:
            return self.engine.ends(num_items / ranks, ranks)
        return (num_items * self.seconds_per_item / ranks,) * ranks


def placement_time(
    profiles: list[PhaseProfile],
    num_items: int,
    micro_batch: int | Sequence[int],
    stage_ranks: list[set[int]],
) -> float:
    """Step time of the stages (in flow order) on the given ranks.

    Stages whose ranks overlap form one group, run one after the other on its ranks (paying
    their switch times); groups on disjoint ranks pipeline. A group's *work* is its whole
    share of the items; its *latency* is how long the group after it waits for its first
    output, and how long the last item takes through it (one micro-batch on one rank, an
    engine's measured first output, or for a group of several stages everything before its
    last stage plus that one's latency) — but an engine and one stage after it on the same
    ranks have their first output after the *first* engine is done (`EngineModel.spread`):
    that rank goes on to the stage with its own responses while the others generate. An engine
    group whose later stages are fed from other ranks (hybrid's rollout and inference around
    the reward) pools its ranks' time after their engines' ends: that input is balanced over
    the ranks by what each takes, so the ranks free early take more of it. The step takes the
    longest of (one group's work + every other group's latency) — the seed's formula
    ``sum_j t_j + (M - 1) t_b`` when every stage is micro-batched — plus the once-per-step
    finish of the last group's stages.

    ``micro_batch``: one size for every stage, or each stage's own (the elastic controller
    sizes each stage apart; a fixed pipeline's first stage may get smaller ones so that its
    ranks have equal counts). A group after such an engine group gets its input only as the
    engines end, not at its own pace from the first one on: with the ``i``-th of ``n``
    engines ending ``d_i`` after the first, it cannot end before ``d_i`` plus the work of what
    the last ``n - i`` bring (at 32 emulated ranks, hybrid's trainer waited ~0.2 s of a 1.7 s
    step on the engines' ends, under-predicted by 12% without this)."""
    if len(profiles) != len(stage_ranks) or not profiles:
        raise ValueError("one rank set per stage profile")
    sizes = [micro_batch] * len(profiles) if isinstance(micro_batch, int) else list(micro_batch)
    if len(sizes) != len(profiles) or min(sizes) < 1:
        raise ValueError("one micro-batch size >= 1 per stage profile")
    groups: list[tuple[set[int], list[int]]] = []
    for index, ranks in enumerate(stage_ranks):
        joined = next((g for g in groups if g[0] & ranks), None)
        if joined is None:
            groups.append((set(ranks), [index]))
        else:
            joined[0].update(ranks)
            joined[1].append(index)
    works, latencies, drains, switches = [], [], [], 0.0
    firsts = []  # per group, each member's own latency (its first output after its first input)
    #: per group fed by its engines' ends: how long after the first each engine ends
    gated: dict[int, list[float]] = {}
    for ranks, members in groups:
        full, first, last = [], [], []
        for i in members:
            p = profiles[i]
            if p.latency_seconds is not None:  # an engine: its share at its rate (or model)
                full.append(p.share_seconds(num_items, len(ranks)))
                first.append(p.latency_seconds)
                last.append(p.latency_seconds)
            else:  # a micro-batch runs on one rank: the ranks share the work, not its latency
                one = sizes[i] * p.seconds_per_item + p.overhead_per_micro_batch
                full.append(math.ceil(num_items / sizes[i]) * one / len(ranks))
                first.append(min(one, p.first_output_seconds) if p.first_output_seconds > 0 else one)
                last.append(max(one, p.drain_at(sizes[i])))
        lead = profiles[members[0]]
        fed_from_elsewhere = len(members) > 1 and all(i - 1 not in members for i in members[1:])
        if lead.latency_seconds is not None and fed_from_elsewhere:
            # An engine whose ranks' later stages are fed from other ranks (hybrid's rollout
            # and inference around the reward): their input is balanced over the ranks by
            # what each has taken, so a rank whose engine ended early takes more of it while
            # the others still generate — the ranks' work is pooled after their engines' ends.
            ends = lead.share_ends(num_items, len(ranks))
            pooled = (sum(ends) + sum(full[1:]) * len(ranks)) / len(ranks)
            works.append(max(ends[-1] + sum(last[1:]), pooled))
        else:
            works.append(sum(full))
        firsts.append(first)
        if len(members) == 2 and lead.latency_seconds is not None:
            # An engine and one stage on its ranks: a rank whose engine is done goes on to that
            # stage with its own responses (the stream between stages on shared ranks is
            # local-first) while the others generate, so the group's first output comes after
            # the first engine's end, not the last one's. (With a stage between them, the last
            # stage waits for that one's stream to end: after the last engine.)
            ends = lead.share_ends(num_items, len(ranks))
            latencies.append(ends[0] + first[-1])
            gated[len(works) - 1] = [end - ends[0] for end in ends]
        else:
            latencies.append(sum(full[:-1]) + first[-1])
        drains.append(latencies[-1] - first[-1] + last[-1])
        if len(members) > 1:
            switches += sum(profiles[i].switch_seconds for i in members)

    def waits(g: int) -> float:
        """What group ``g``'s work waits on from the others: their latencies (the first output
        of those before it, the last item's way through those after it) — but a group whose
        stages come before and after ``g``'s (hybrid's rollout and inference around the reward)
        feeds ``g`` at its first stage's own first output, not after its whole latency."""
        first, end = groups[g][1][0], groups[g][1][-1]
        return sum(
            sum(firsts[h])
            if members[0] < first < members[-1]
            else drains[h]
            if members[0] > end
            else latencies[h]
            for h, (_, members) in enumerate(groups)
            if h != g
        )

    def gate(g: int) -> float:
        """How much longer group ``g``'s work takes than from the first output on, waiting on
        the ends of an engine group before it (0 if none: its input comes at its own pace)."""
        first, late = groups[g][1][0], 0.0
        for h, offsets in gated.items():
            if groups[h][1][-1] < first:
                n = len(offsets)
                late = max(late, *(offset - works[g] * i / n for i, offset in enumerate(offsets)))
        return late

    longest = max(work + waits(g) + gate(g) for g, work in enumerate(works))
    tail = sum(profiles[i].finish_at(num_items, len(stage_ranks[i])) for i in groups[-1][1])
    return round(profiles[0].start_seconds + longest + switches + tail, 6)
