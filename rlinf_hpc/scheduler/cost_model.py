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

import heapq
import math
import random
from dataclasses import dataclass, field, replace


def pipeline_time(stage_times: list[float], num_micro_batches: int) -> float:
    """Step time of a pipeline of stages (seconds per micro-batch each) over M micro-batches."""
    if not stage_times or num_micro_batches < 1:
        raise ValueError("a pipeline needs at least one stage and one micro-batch")
    return sum(stage_times) + (num_micro_batches - 1) * max(stage_times)


def slot_ends(lengths: list[int], slots: int) -> list[int]:
    """When each request ends (in decode steps) on an engine of ``slots`` sequences at once,
    each taking the slot that frees first (continuous batching, in arrival order).

    >>> slot_ends([3, 1, 2, 2], slots=2)
    [3, 1, 3, 5]
    """
    free = [0] * max(1, min(slots, len(lengths)))
    ends = []
    for length in lengths:
        end = free[0] + length
        heapq.heapreplace(free, end)
        ends.append(end)
    return ends


def collocated_time(phase_times: list[float], switch_times: list[float] = ()) -> float:  # type: ignore[assignment]
    """Step time of phases run one after another on the same ranks, with switches between."""
    return sum(phase_times) + sum(switch_times)


@dataclass(frozen=True)
class EngineModel:
    """A continuous-batching engine as its warm-up measured it: a decode step with ``k``
    sequences in the batch takes ``step_s + seq_step_s * k`` seconds (fitted to the engine's
    reported steps), each request needs one of ``lengths`` decode steps (the responses it
    generated), and at most ``slots`` run at once.

    Its time on a share of ``n`` requests is ``step_s * makespan + seq_step_s * sum(lengths)``,
    the makespan from placing the requests into slots as they free: not linear in ``n``. Up to
    ``slots`` requests the makespan is the longest response, so a small share costs nearly
    what a larger one does — a linear model (seconds per item from one share) gets another
    share's time wrong by as much as the tail is long.

    >>> engine = EngineModel(step_s=0.01, seq_step_s=0.001, slots=4, lengths=(100,))
    >>> engine.seconds(4, engines=1)  # one wave: 100 steps of 4 sequences
    1.4
    >>> engine.seconds(8, engines=1)  # two waves
    2.8
    >>> engine.seconds(2, engines=1)  # half full: the same 100 steps, cheaper each
    1.2
    """

    step_s: float
    seq_step_s: float
    slots: int
    lengths: tuple[int, ...]
    #: Resamples of the lengths averaged per prediction (fixed seeds: deterministic).
    draws: int = 8
    #: Measured engine time over modelled (`calibrated`): what the fitted decode steps leave
    #: out — requests arriving over time rather than all at once, the host's own delays.
    calibration: float = 1.0
    #: Partial rollouts: the engine stops once all its requests have started and at most this
    #: fraction of them still decode (the rest goes on in its next step). Its time is then
    #: the fixed cost of the decode steps up to that point plus the per-sequence cost of a
    #: step's worth of tokens (in a steady state every token is decoded once, in one step or
    #: the next).
    stop_fraction: float = 0.0
    #: Per model (not copied by `dataclasses.replace`: a changed copy predicts anew).
    _memo: dict[tuple[int, int], tuple[float, float, float]] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    def seconds(self, per_engine: float, engines: int) -> float:
        """Expected time of the slowest of ``engines`` engines with ``per_engine`` requests
        each (requests drawn from the measured lengths)."""
        return self.spread(per_engine, engines)[2]

    def spread(self, per_engine: float, engines: int) -> tuple[float, float, float]:
        """Expected times of the first, the mean and the last of ``engines`` engines to end,
        ``per_engine`` requests each: on ranks shared with later stages, a rank whose engine
        ends early goes on to those stages while the others still generate.

        >>> EngineModel(0.01, 0.001, 4, (100,)).spread(4, engines=3)  # alike: no spread
        (1.4, 1.4, 1.4)
        """
        n = max(0, round(per_engine))
        if n == 0 or not self.lengths:
            return (0.0, 0.0, 0.0)
        key = (n, max(1, engines))
        if key not in self._memo:
            if len(set(self.lengths)) == 1:  # nothing to draw: every engine alike
                one = self._time([self.lengths[0]] * n)
                self._memo[key] = (one, one, one)
            else:
                sums = [0.0, 0.0, 0.0]
                for draw in range(self.draws):
                    rng = random.Random(draw * 1_000_003 + n * 101 + engines)
                    times = [self._time(rng.choices(self.lengths, k=n)) for _ in range(key[1])]
                    for i, value in enumerate((min(times), sum(times) / len(times), max(times))):
                        sums[i] += value
                first, mean, last = (total / self.draws for total in sums)
                self._memo[key] = (first, mean, last)
        return self._memo[key]

    def _time(self, lengths: list[int]) -> float:
        ends = slot_ends(lengths, self.slots)
        steps = max(ends)
        if self.stop_fraction > 0:
            running = min(len(lengths) - 1, math.floor(self.stop_fraction * len(lengths)))  # go on next step
            last_start = max(end - length for end, length in zip(ends, lengths, strict=True))
            steps = max(last_start, sorted(ends)[len(ends) - running - 1])
        return self.calibration * (self.step_s * steps + self.seq_step_s * sum(lengths))

    def calibrated(self, busy_s: list[float], items: list[int]) -> EngineModel:
        """This model scaled so that its mean engine time on the measured shares (``items``
        requests on each engine) is the measured mean (``busy_s``), within [0.67, 1.5]: the
        decode-step fit alone left engines 10-15% short at 24-32 emulated ranks on 2 cores.

        >>> engine = EngineModel(0.01, 0.001, 4, (100,))
        >>> engine.calibrated([1.54, 1.54], [4, 4]).seconds(4, engines=2)
        1.54
        """
        engines = len(items)
        modelled = self.spread(sum(items) / max(1, engines), engines)[1] if engines else 0.0
        if not busy_s or modelled <= 0:
            return self
        ratio = sum(busy_s) / len(busy_s) / (modelled / self.calibration)
        return replace(self, calibration=min(1.5, max(1 / 1.5, ratio)))


def fit_engine(steps: list[tuple[float, int, int]], lengths: list[int], slots: int) -> EngineModel | None:
    """An `EngineModel` from ``(seconds, decode steps, sequences in the batch)`` samples: the
    least-squares line of seconds per decode step over batch size (weighted by decode steps,
    both coefficients >= 0). None without samples or lengths."""
    samples = [(s / n, k, n) for s, n, k in steps if n > 0 and k > 0 and s >= 0]
    if not samples or not lengths or slots < 1:
        return None
    weight = sum(n for _, _, n in samples)
    mean_k = sum(k * n for _, k, n in samples) / weight
    mean_t = sum(t * n for t, _, n in samples) / weight
    var = sum(n * (k - mean_k) ** 2 for _, k, n in samples)
    slope = sum(n * (k - mean_k) * (t - mean_t) for t, k, n in samples) / var if var > 0 else 0.0
    slope = max(0.0, slope)
    intercept = mean_t - slope * mean_k
    if intercept < 0:  # a line through the origin instead
        intercept, slope = 0.0, mean_t / mean_k
    return EngineModel(intercept, slope, slots, tuple(lengths))


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


@dataclass(frozen=True)
class Prediction:
    """Predicted step time of each placement, and the choice."""

    collocated: float
    disaggregated: float
    ranks_per_phase: dict[str, int] = field(default_factory=dict)

    @property
    def choice(self) -> str:
        return "collocated" if self.collocated <= self.disaggregated else "disaggregated"


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
    an engine gains nothing at all; ranks that shorten nothing are given out as above.

    >>> split_ranks([PhaseProfile("gen", 2.75), PhaseProfile("train", 0.45)], 15)
    {'gen': 13, 'train': 2}
    """
    if num_ranks < len(profiles):
        raise ValueError(f"{len(profiles)} phases cannot run disaggregated on {num_ranks} ranks")
    work = {p.name: p.seconds_per_item for p in profiles}
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
    profiles: list[PhaseProfile], shares: dict[str, int], num_items: int, micro_batch: int
) -> float:
    return placement_time(profiles, num_items, micro_batch, _disjoint_sets(profiles, shares))


def _disjoint_sets(profiles: list[PhaseProfile], shares: dict[str, int]) -> list[set[int]]:
    """Rank sets of the shares' sizes, one after the other, in the profiles' order."""
    sets, first = [], 0
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
) -> Prediction:
    """Collocated vs disaggregated step time for ``num_items`` items on ``num_ranks`` ranks.

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
    micro_batches = math.ceil(num_items / micro_batch)
    # collocated: each phase uses every rank on the whole batch, one micro-batch per rank share
    phases = [
        p.share_seconds(num_items, num_ranks)
        + math.ceil(micro_batches / num_ranks) * p.overhead_per_micro_batch
        for p in profiles
    ]
    together = (
        profiles[0].start_seconds
        + collocated_time(phases, [p.switch_seconds for p in profiles])
        + profiles[-1].finish_seconds
    )
    if num_ranks < len(profiles):
        return Prediction(max(together, measured_collocated or 0.0), math.inf, {})
    ranks = split_ranks(profiles, num_ranks, num_items, micro_batch)
    apart = _split_time(profiles, ranks, num_items, micro_batch)
    if measured_collocated is not None and measured_collocated > together:
        # per rank: one call per stage collocated, one call disaggregated
        together, apart = measured_collocated, apart + (measured_collocated - together) / len(profiles)
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
    output, and how long the last item takes through it (one micro-batch on one rank, an
    engine's measured first output, or for a group of several stages everything before its
    last stage plus that one's latency) — but an engine and one stage after it on the same
    ranks have their first output after the *first* engine is done (`EngineModel.spread`):
    that rank goes on to the stage with its own responses while the others generate. The step
    takes the
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
    firsts = []  # per group, each member's own latency (its first output after its first input)
    for ranks, members in groups:
        full, first = [], []
        for i in members:
            p = profiles[i]
            if p.latency_seconds is not None:  # an engine: its share at its rate (or model)
                full.append(p.share_seconds(num_items, len(ranks)))
                first.append(p.latency_seconds)
            else:  # a micro-batch runs on one rank: the ranks share the work, not its latency
                one = micro_batch * p.seconds_per_item + p.overhead_per_micro_batch
                full.append(micro_batches * one / len(ranks))
                first.append(one)
        works.append(sum(full))
        firsts.append(first)
        lead = profiles[members[0]]
        if len(members) == 2 and lead.latency_seconds is not None:
            # An engine and one stage on its ranks: a rank whose engine is done goes on to that
            # stage with its own responses (the stream between stages on shared ranks is
            # local-first) while the others generate, so the group's first output comes after
            # the first engine's end, not the last one's. (With a stage between them, the last
            # stage waits for that one's stream to end: after the last engine.)
            latencies.append(lead.share_spread(num_items, len(ranks))[0] + first[-1])
        else:
            latencies.append(sum(full[:-1]) + first[-1])
        if len(members) > 1:
            switches += sum(profiles[i].switch_seconds for i in members)

    def waits(g: int) -> float:
        """What group ``g``'s work waits on from the others: their latencies — but a group whose
        stages come before and after ``g``'s (hybrid's rollout and inference around the reward)
        feeds ``g`` at its first stage's own first output, not after its whole latency."""
        first = groups[g][1][0]
        return sum(
            sum(firsts[h]) if members[0] < first < members[-1] else latencies[h]
            for h, (_, members) in enumerate(groups)
            if h != g
        )

    longest = max(work + waits(g) for g, work in enumerate(works))
    tail = sum(profiles[i].finish_seconds for i in groups[-1][1])
    return round(profiles[0].start_seconds + longest + switches + tail, 6)
