"""Elastic micro-batch size: smaller when the downstream stage waits on upstream, larger under
memory pressure, always between a configured minimum and maximum (seed: base 256, minimum 8;
shrink toward 32 when upstream latency is high, grow toward 128 under memory pressure).

Once the downstream stage keeps up again (waits under a quarter of the threshold for
``patience`` micro-batches in a row) a shrunken size doubles back toward the size it started
from, so one slow start (pipeline fill) does not leave a stage at tiny micro-batches for good.

A change must pay for itself. Given the seconds each micro-batch took (``items``,
``seconds``), the controller keeps the per-item time at each size, and a halving is on
probation for ``patience`` micro-batches: if the smaller size costs more than
``batch_penalty`` times as much per item, it goes back and never below again — a batch-bound
stage (batched decoding, whose call waits on its longest response) loses more to small
batches than the downstream wait saves. Such a stage, still waited on, then tries the double
size, and keeps it only if it is cheaper per item by that factor. A stage whose per-item cost
does not depend on the size (most compute-bound ones) just shrinks, as the seed's rule says.
What was learnt lives in a ``knowledge`` dict the caller carries from step to step (`adopt`).

Every change is returned with its reason so the runtime can log it and put it in the metrics.

>>> batching = ElasticBatching(minimum=8, maximum=256, size=64, wait_threshold_s=0.05)
>>> batching.update(downstream_wait_s=0.2, memory_fraction=0.3)
(32, 'downstream waited 0.200 s on upstream (> 0.050 s): halve to 32')
>>> batching.update(downstream_wait_s=0.0, memory_fraction=0.95)
(64, 'memory at 95% (> 85%): double to 64')
>>> batching.update(downstream_wait_s=0.0, memory_fraction=0.3)
(64, None)
>>> batching.update(0.2, 0.3)[0], [batching.update(0.0, 0.3)[0] for _ in range(4)]
(32, [32, 32, 32, 64])

A batch-bound stage (one second per call whatever its size, up to 64):

>>> bound = ElasticBatching(minimum=8, maximum=128, size=32, wait_threshold_s=0.05)
>>> bound.update(0.2, 0.3, items=32, seconds=1.0)
(16, 'downstream waited 0.200 s on upstream (> 0.050 s): halve to 16')
>>> [bound.update(0.2, 0.3, items=16, seconds=1.0)[0] for _ in range(3)]  # on probation
[16, 16, 16]
>>> bound.update(0.2, 0.3, items=16, seconds=1.0)[1]
'per-item time at 16 is 2.0x that at 32 (> 1.25x): back to 32, and no smaller from now on'
>>> bound.update(0.2, 0.3, items=32, seconds=1.0)[1]
'downstream waits, and smaller micro-batches cost more per item here: try 64'
>>> [bound.update(0.2, 0.3, items=64, seconds=1.0)[0] for _ in range(4)]  # half the cost: kept
[64, 64, 64, 64]
>>> bound.update(0.2, 0.3, items=64, seconds=1.0)[1]
'downstream waits, and smaller micro-batches cost more per item here: try 128'
>>> [bound.update(0.2, 0.3, items=128, seconds=2.0)[0] for _ in range(4)]  # no cheaper: back
[128, 128, 128, 64]
>>> [bound.update(0.2, 0.3, items=64, seconds=1.0)[0] for _ in range(3)]  # and stays
[64, 64, 64]

The same second per call, but the 16 items are twice as long as the 32 were (the last of a
long-tailed generation arrive few at a time): per token they cost the same, so the smaller
size is not held against the stage, which keeps shrinking while downstream waits:

>>> tail = ElasticBatching(minimum=8, maximum=128, size=32, wait_threshold_s=0.05)
>>> tail.update(0.2, 0.3, items=32, seconds=1.0, weight=32_000)[0]
16
>>> [tail.update(0.2, 0.3, items=16, seconds=1.0, weight=32_000)[0] for _ in range(4)]
[16, 16, 16, 8]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ElasticBatching:
    """The controller; call `update` once per micro-batch (or per step) with fresh signals."""

    minimum: int = 8
    maximum: int = 256
    size: int = 32
    #: Downstream waiting longer than this for a micro-batch counts as upstream latency.
    wait_threshold_s: float = 0.05
    #: Device (or host) memory in use above this fraction counts as pressure.
    memory_threshold: float = 0.85
    #: Micro-batches in a row with downstream keeping up before a shrunken size grows back.
    patience: int = 4
    #: The size a shrunken one grows back to (default: ``size`` at construction).
    start: int | None = None
    #: A smaller size may cost at most this much more per item than the current one.
    batch_penalty: float = 1.25
    #: (old size, new size, reason) of every change so far.
    history: list[tuple[int, int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= self.minimum <= self.maximum:
            raise ValueError(
                f"micro-batch minimum ({self.minimum}) must be >= 1 and <= maximum ({self.maximum})"
            )
        self.size = min(max(self.size, self.minimum), self.maximum)
        self.start = min(max(self.start or self.size, self.minimum), self.maximum)
        self._calm = 0
        self.adopt({})

    def probe_after_move(self, before: int) -> None:
        """The ranks just moved (`auto`) and this stage starts at a smaller size than the
        ``before`` its ranks carried, with nothing measured on the new placement: after
        `patience` micro-batches it tries ``before`` once, on probation (kept if cheaper per
        item by the `batch_penalty`, else back, and no larger from then on). Without it a stage
        whose downstream waits a little — under the halving threshold, over the calm one —
        never learns whether the small size costs more per item (a CPU rollout stayed at 2
        prompts per call, ~40% slower per item than at 4-8).

        >>> moved = ElasticBatching(minimum=2, maximum=32, size=2, start=8, patience=2)
        >>> moved.probe_after_move(8)
        >>> [moved.update(0.02, 0.3, items=2, seconds=0.04)[0] for _ in range(2)]
        [2, 8]
        >>> moved.update(0.02, 0.3, items=8, seconds=0.08)  # 10 ms per item against 20
        (8, None)
        >>> _ = [moved.update(0.02, 0.3, items=8, seconds=0.08) for _ in range(2)]
        >>> moved.size, moved.batch_bound  # kept: smaller sizes are known to cost more here
        (8, True)
        """
        if before > self.size:
            self._k["probe"] = before

    def adopt(self, knowledge: dict[str, Any]) -> None:
        """Keep what is learnt in ``knowledge`` (the caller's, carried from one step's
        controller to the next): per-item seconds per size, the sizes found not worth going
        below or above, and a change still on probation."""
        self._k = knowledge
        knowledge.setdefault("per_item", {})
        knowledge.setdefault("floor", self.minimum)
        knowledge.setdefault("ceiling", self.maximum)
        knowledge.setdefault("trial", None)  # the size before a change on probation
        knowledge.setdefault("since", 0)  # micro-batches since the last change
        knowledge.setdefault("probe", None)  # a larger size to try once (`probe_after_move`)

    @property
    def batch_bound(self) -> bool:
        """Whether smaller micro-batches were found to cost more per item: such a stage waits
        for full micro-batches (for at most `fill_wait_s`), since a short one costs nearly as
        much as a full one.
        A larger size merely on trial does not count: a last stage trying it while several
        ranks share its stream held the items it waited for (up to the end of the stream),
        while the others took the rest one by one."""
        return self._k["floor"] > self.minimum

    def fill_wait_s(self) -> float | None:
        """How long a batch-bound stage waits for its micro-batch to fill: the time a full one
        takes, from the per-item cost measured at this size (None if not measured yet: wait
        until full). The ski-rental rule of thumb: wait no longer than going on without the rest
        would cost (at most one more call), while a stream that trickles — the last responses of
        a long-tailed generation, a few at a time — would otherwise hold its last micro-batch
        until the stream's end.

        >>> bound = ElasticBatching(minimum=8, maximum=128, size=32)
        >>> bound.fill_wait_s() is None
        True
        >>> _ = bound.update(0.0, 0.3, items=32, seconds=0.4)
        >>> round(bound.fill_wait_s(), 3)  # 32 items at 12.5 ms each
        0.4
        """
        measured = self._k["per_item"].get(_bucket(self.size))
        if measured is None:
            return None
        seconds, items = measured[0], measured[1]
        return seconds / max(items, 1) * self.size

    def _ratios(self, a: int, b: int) -> tuple[float, float] | None:
        """Time per item at size ``a`` over that at ``b``, and the same per unit of weight:
        (the smaller, the larger) of the two; None if a size was not measured. A size counts
        as costlier only if it is so both ways (the smaller), and as cheaper likewise (the
        larger): micro-batches of one size may hold longer items than another's (the last of a
        long-tailed generation arrive few at a time), which a stage whose cost grows with the
        length pays per item but not per token, and one whose cost does not, per token."""
        per_item = self._k["per_item"]
        a, b = _bucket(a), _bucket(b)
        if a not in per_item or b not in per_item:
            return None
        (a_s, a_n, *a_w), (b_s, b_n, *b_w) = per_item[a], per_item[b]  # weights: newer entries
        by_item = (a_s / a_n) / max(b_s / b_n, 1e-12)
        by_weight = (a_s / (a_w or [a_n])[0]) / max(b_s / (b_w or [b_n])[0], 1e-12)
        return min(by_item, by_weight), max(by_item, by_weight)

    def update(
        self,
        downstream_wait_s: float,
        memory_fraction: float,
        items: int | None = None,
        seconds: float | None = None,
        downstream_apart: bool = True,
        weight: float | None = None,
    ) -> tuple[int, str | None]:
        """The size for the next micro-batch, and why it changed (None if it did not). ``items``
        and ``seconds``: the micro-batch just done, for the per-item cost at its size;
        ``weight``: its items' total weight (their tokens, say; default: one per item), for the
        cost per unit of weight beside it (`_ratios`).
        ``downstream_apart=False``: no stage runs on other ranks at the same time waiting for
        this one's output (the last stage, or the next one shares its ranks), so small
        micro-batches buy nothing: a larger size is tried, and kept if cheaper per item."""
        k = self._k
        old = self.size
        reason = None
        if items and seconds is not None:
            size = _bucket(items)  # a short micro-batch counts for the nearest power of two
            total_s, total_items, *total_weight = k["per_item"].get(size, (0.0, 0, 0.0))
            units = weight if weight is not None and weight > 0 else items
            # the means are the estimates
            k["per_item"][size] = (
                total_s + seconds,
                total_items + items,
                (total_weight or [total_items])[0] + units,
            )
        k["since"] += 1
        calm = downstream_wait_s < self.wait_threshold_s / 4
        trial = k["trial"] if k["since"] >= self.patience else None
        ratios = self._ratios(old, trial) if trial is not None else None
        # smaller on trial: costlier only if so both ways; larger: cheaper only if so both ways
        ratio = None if ratios is None else ratios[0] if old < trial else ratios[1]  # type: ignore[operator]
        if trial is not None:
            k["trial"] = None
        if ratio is not None and old < trial and ratio > self.batch_penalty:
            self.size = k["floor"] = trial
            reason = (
                f"per-item time at {old} is {ratio:.1f}x that at {trial} "
                f"(> {self.batch_penalty:g}x): back to {trial}, and no smaller from now on"
            )
        elif ratio is not None and old > trial and ratio * self.batch_penalty > 1:
            self.size = k["ceiling"] = trial
            reason = (
                f"per-item time at {old} is {ratio:.2f}x that at {trial} (not "
                f"{1 / self.batch_penalty:.2f}x or less): back to {trial}, and no larger from now on"
            )
        elif ratio is not None and old > trial:
            k["floor"] = old  # the larger size was worth it: the smaller one is known costlier
        elif memory_fraction > self.memory_threshold and self.size < self.maximum:
            self.size = min(self.size * 2, self.maximum)
            reason = f"memory at {memory_fraction:.0%} (> {self.memory_threshold:.0%}): double to {self.size}"
        elif k["probe"] and k["trial"] is None and items and k["since"] >= self.patience:
            probe, k["probe"] = min(k["probe"], self.maximum, k["ceiling"]), None
            if probe > self.size:
                self.size = probe
                reason = f"started small after a move: try {probe}, the size before it, once"
                k["trial"] = old
        elif downstream_wait_s > self.wait_threshold_s and k["trial"] is None:
            smaller = max(self.size // 2, self.minimum, k["floor"])
            larger = min(self.size * 2, self.maximum, k["ceiling"])
            if smaller < self.size:
                self.size = smaller
                reason = (
                    f"downstream waited {downstream_wait_s:.3f} s on upstream "
                    f"(> {self.wait_threshold_s:.3f} s): halve to {self.size}"
                )
            elif k["floor"] > self.minimum and larger > self.size:  # batch-bound: try larger
                self.size = larger
                reason = f"downstream waits, and smaller micro-batches cost more per item here: try {larger}"
            elif items and larger > self.size and _bucket(larger) not in k["per_item"]:
                # at the smallest size with no smaller one left to try, nothing says whether a
                # small micro-batch costs more per item here: try the larger once (a stage that
                # starts small never halved into it and never learnt; `auto` starts moved
                # stages at the minimum: a CPU rollout stayed at 2 prompts, 1.8x costlier per
                # item than 4, and the step took 1.7-1.8 s against 1.4 from 8)
                self.size = larger
                reason = f"downstream waits and {old} is the smallest size: try {larger} once"
            if reason is not None and items:  # judged only when costs are known
                k["trial"] = old
        elif (
            not downstream_apart
            and items
            and k["trial"] is None
            and k["since"] >= self.patience
            and min(self.size * 2, self.maximum, k["ceiling"]) > self.size
        ):
            self.size = min(self.size * 2, self.maximum, k["ceiling"])
            reason = f"nothing downstream waits on small micro-batches: try {self.size}"
            k["trial"] = old
        elif calm and self._calm + 1 >= self.patience and self.size < self.start:  # type: ignore[operator]
            self.size = min(self.size * 2, self.start)  # type: ignore[type-var]
            reason = f"downstream kept up for {self.patience} micro-batches: grow back to {self.size}"
        self._calm = self._calm + 1 if calm and reason is None else 0
        if reason is not None:
            k["since"] = 0
            self.history.append((old, self.size, reason))
        return self.size, reason


def _bucket(items: int) -> int:
    """The power of two nearest to ``items`` (per-item costs are kept per bucket)."""
    return 1 << max(0, round(math.log2(max(1, items))))


def micro_batch_bound(device_bytes: float, state_bytes: float, bytes_per_sample: float) -> int:
    """The seed's rule for the largest micro-batch: 0.3 x (device memory - model state) /
    memory per sample (at least 1).

    >>> micro_batch_bound(80e9, 15.2e9, 0.06e9)
    324
    """
    if bytes_per_sample <= 0:
        raise ValueError("bytes_per_sample must be > 0")
    return max(1, int(0.3 * max(0.0, device_bytes - state_bytes) / bytes_per_sample))
