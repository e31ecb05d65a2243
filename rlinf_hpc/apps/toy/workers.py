"""`ToyStage`: a configurable pipeline stage for trying placements and the micro flow.

Each item is a dict ``{"id", "value", "trail"}``; the stage applies its operation to ``value``
and appends its name to ``trail``, so the result of a whole pipeline is a deterministic function
of the input whatever ranks processed what. ``seconds_per_item`` makes a stage slow (sleep, so
ranks overlap even on an oversubscribed node); ``state_mb`` gives it a model-sized state that a
full context switch has to move.
"""

from __future__ import annotations

import time
from typing import Any

from rlinf_hpc.workers.base import Worker

_OPERATIONS = {
    "affine": lambda v: 3 * v + 1,
    "square": lambda v: (v * v) % 1_000_003,
    "negate": lambda v: -v,
}


class ToyStage(Worker):
    """``process(batch)`` per micro-batch; ``total()`` once at the end of a step."""

    def setup(
        self,
        operation: str = "affine",
        seconds_per_item: float = 0.0,
        state_mb: float = 0.0,
        memory_fraction: float | None = None,
        memory_profile: dict[str, float] | None = None,
    ) -> None:
        if operation not in _OPERATIONS:
            raise ValueError(f"operation must be one of {sorted(_OPERATIONS)}, got '{operation}'")
        self.operation = operation
        self.seconds_per_item = float(seconds_per_item)
        self._memory_fraction = memory_fraction
        self._memory_profile = memory_profile
        self._sum = 0
        self.state = None
        if state_mb > 0:
            import torch

            torch.manual_seed(self.rank_seed())
            self.state = torch.nn.Linear(int(state_mb * 2**20 / 4 / 1024), 1024, bias=False)

    def switch_state(self) -> Any:
        return self.state

    def memory_fraction(self) -> float:
        """The configured fraction when given (to try the elastic sizing), else the real one."""
        return super().memory_fraction() if self._memory_fraction is None else self._memory_fraction

    def memory_profile(self) -> dict[str, float] | None:
        """The configured device (``{device_gb, state_gb, gb_per_sample}``) when given, to try
        the micro-batch bound without a GPU; else the real measurement."""
        if self._memory_profile is None:
            return super().memory_profile()
        keys = {"device_gb": "device_bytes", "state_gb": "state_bytes", "gb_per_sample": "bytes_per_sample"}
        return {keys[k]: float(v) * 1e9 for k, v in self._memory_profile.items()}

    def process(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.seconds_per_item:
            time.sleep(self.seconds_per_item * len(batch))
        apply = _OPERATIONS[self.operation]
        out = []
        for item in batch:
            value = apply(item["value"])
            self._sum += value
            out.append({"id": item["id"], "value": value, "trail": [*item["trail"], self.component]})
        return out

    def total(self) -> int:
        """Sum of this rank's output values since the last call (then reset)."""
        total, self._sum = self._sum, 0
        return total
