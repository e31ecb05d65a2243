"""A continuous-batching engine's time, as the cost model needs it (`EngineModel`).

An engine's time is not proportional to its share of the requests: up to its slots, a share's
time is its longest response (`slot_ends`), so a small share costs nearly what a larger one
does. `fit_engine` fits the model to the decode steps an engine reported; `cost_model`'s
`PhaseProfile` carries one for a continuous stage.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field, replace


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
    #: fraction of them still decode (the rest goes on in its next step, admitted first). Its
    #: time is then the fixed cost of the decode steps up to that point plus the per-sequence
    #: cost of a step's worth of tokens (in a steady state every token is decoded once, in one
    #: step or the next). The requests a step carries in are modelled too, from a step before
    #: it drawn alike: they hold slots first, so the step's last requests start later.
    stop_fraction: float = 0.0
    #: Per model (not copied by `dataclasses.replace`: a changed copy predicts anew).
    _memo: dict[tuple[int, int], tuple[float, ...]] = field(
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
        ends = self.ends(per_engine, engines)
        mean = ends[0] if ends[0] == ends[-1] else sum(ends) / len(ends)
        return (ends[0], mean, ends[-1])

    def ends(self, per_engine: float, engines: int) -> tuple[float, ...]:
        """Expected end of each of ``engines`` engines with ``per_engine`` requests each, in
        order (the i-th earliest, averaged over draws of the lengths): when a rank shared with
        a later stage has its own responses to hand on.

        >>> EngineModel(0.01, 0.0, 1, (10, 100)).ends(2, engines=3)[0] < 2.0
        True
        """
        n, count = max(0, round(per_engine)), max(1, engines)
        if n == 0 or not self.lengths:
            return (0.0,) * count
        key = (n, count)
        if key not in self._memo:
            if len(set(self.lengths)) == 1:  # nothing to draw: every engine alike
                same = [self.lengths[0]] * n
                self._memo[key] = (self._time(same, self._carried(same)),) * count
            else:
                sums = [0.0] * count
                for draw in range(self.draws):
                    rng = random.Random(draw * 1_000_003 + n * 101 + engines)
                    times = sorted(self._drawn_time(rng, n) for _ in range(count))
                    sums = [total + value for total, value in zip(sums, times, strict=True)]
                self._memo[key] = tuple(total / self.draws for total in sums)
        return self._memo[key]

    def _drawn_time(self, rng: random.Random, n: int) -> float:
        lengths = rng.choices(self.lengths, k=n)
        before = rng.choices(self.lengths, k=n) if self.stop_fraction > 0 else []
        return self._time(lengths, self._carried(before))

    def _stop(self, lengths: list[int], carried: list[int]) -> tuple[int, list[int]]:
        """Decode steps until the engine stops on ``carried`` (admitted first) and then
        ``lengths``, and the steps left of each request it carries on."""
        requests = carried + lengths
        ends = slot_ends(requests, self.slots)
        steps = max(ends)
        if self.stop_fraction > 0:
            # at most this many go on in the next step
            running = min(len(requests) - 1, math.floor(self.stop_fraction * len(requests)))
            last_start = max(end - length for end, length in zip(ends, requests, strict=True))
            steps = max(last_start, sorted(ends)[len(ends) - running - 1])
        return steps, [end - steps for end in ends if end > steps]

    def _carried(self, before: list[int]) -> list[int]:
        """What a step on ``before`` leaves to the next (partial rollouts; [] otherwise).

        >>> EngineModel(0.0, 0.0, 4, (1,), stop_fraction=0.25)._carried([10, 1, 1, 1])
        [9]
        """
        return self._stop(before, [])[1] if self.stop_fraction > 0 and before else []

    def _time(self, lengths: list[int], carried: list[int]) -> float:
        steps, _ = self._stop(lengths, carried)
        return self.calibration * (self.step_s * steps + self.seq_step_s * sum(lengths))

    def _share_time(self, share: list[int]) -> float:
        """The expected time of an engine given these responses in an order drawn at random,
        as the model draws its shares (an engine reports its lengths as they finish, the
        shortest first: in that order, a share of more than ``slots`` would hold its longest
        ones back for a second wave and cost 11% more than the engine took at 16 emulated
        ranks)."""
        if len(share) <= self.slots:  # one wave: the order does not matter
            return self._time(list(share), [])
        total = 0.0
        for draw in range(self.draws):
            order = list(share)
            random.Random(draw * 1_000_003 + len(share)).shuffle(order)
            total += self._time(order, [])
        return total / self.draws

    def calibrated(
        self, busy_s: list[float], items: list[int], shares: list[list[int]] | None = None
    ) -> EngineModel:
        """This model scaled so that its mean engine time on the measured shares (``items``
        requests on each engine) is the measured mean (``busy_s``), within [0.67, 1.5]: the
        decode-step fit alone left engines 10-15% short at 24-32 emulated ranks on 2 cores.

        ``shares``: each engine's own response lengths. The model's time on them is what the
        measured time is compared with; without them it is the model's expected time on
        shares drawn from all the lengths, and one step's engines are a single draw: with an
        8% tail of responses 4-5x as long, which engines got the long ones moved their mean
        by 5-10% either way, and the calibration with it (0.90 on an exact emulated engine,
        the step predicted 14% short at 24 ranks).

        >>> engine = EngineModel(0.01, 0.001, 4, (100,))
        >>> engine.calibrated([1.54, 1.54], [4, 4]).seconds(4, engines=2)
        1.54
        >>> drawn = EngineModel(0.01, 0.0, 4, (10, 100))
        >>> drawn.calibrated([1.0, 0.1], [1, 1], shares=[[100], [10]]).calibration
        1.0
        """
        engines = len(items)
        if not busy_s or not engines:
            return self
        own = shares is not None and len(shares) == engines and self.stop_fraction == 0
        if own and all(len(share) == n for share, n in zip(shares or [], items, strict=True)):
            modelled = sum(self._share_time(share) for share in shares or []) / engines
        else:
            modelled = self.spread(sum(items) / engines, engines)[1]
        if modelled <= 0:
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
