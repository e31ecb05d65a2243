"""Elastic micro-batch size: smaller when the downstream stage waits on upstream, larger under
memory pressure, always between a configured minimum and maximum (seed: base 256, minimum 8;
shrink toward 32 when upstream latency is high, grow toward 128 under memory pressure).

Once the downstream stage keeps up again (waits under a quarter of the threshold for
``patience`` micro-batches in a row) a shrunken size doubles back toward the size it started
from, so one slow start (pipeline fill) does not leave a stage at tiny micro-batches for good.

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
"""

from __future__ import annotations

from dataclasses import dataclass, field


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

    def update(self, downstream_wait_s: float, memory_fraction: float) -> tuple[int, str | None]:
        """The size for the next micro-batch, and why it changed (None if it did not)."""
        old = self.size
        reason = None
        calm = downstream_wait_s < self.wait_threshold_s / 4
        if memory_fraction > self.memory_threshold and self.size < self.maximum:
            self.size = min(self.size * 2, self.maximum)
            reason = f"memory at {memory_fraction:.0%} (> {self.memory_threshold:.0%}): double to {self.size}"
        elif downstream_wait_s > self.wait_threshold_s and self.size > self.minimum:
            self.size = max(self.size // 2, self.minimum)
            reason = (
                f"downstream waited {downstream_wait_s:.3f} s on upstream "
                f"(> {self.wait_threshold_s:.3f} s): halve to {self.size}"
            )
        elif calm and self._calm + 1 >= self.patience and self.size < self.start:
            self.size = min(self.size * 2, self.start)
            reason = f"downstream kept up for {self.patience} micro-batches: grow back to {self.size}"
        self._calm = self._calm + 1 if calm and reason is None else 0
        if reason is not None:
            self.history.append((old, self.size, reason))
        return self.size, reason
