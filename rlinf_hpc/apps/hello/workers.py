"""Workers of the `hello` app: apply a small arithmetic operation to numbers."""

from __future__ import annotations

from typing import Any

from rlinf_hpc.workers.base import Worker

_OPERATIONS = {
    "double": lambda x: 2 * x,
    "square": lambda x: x * x,
    "negate": lambda x: -x,
}


class ArithmeticWorker(Worker):
    """Applies ``operation`` to the numbers it is sent and says where it ran."""

    def setup(self, operation: str = "double") -> None:
        if operation not in _OPERATIONS:
            raise ValueError(f"operation '{operation}' is not one of {sorted(_OPERATIONS)}")
        self.operation = operation

    def apply(self, numbers: list[int]) -> dict[str, Any]:
        """Apply the operation to each number; return results plus this rank's identity."""
        function = _OPERATIONS[self.operation]
        return {
            "rank": self.rank,
            "group_rank": self.group_rank,
            "device": self.device,
            "inputs": list(numbers),
            "outputs": [function(x) for x in numbers],
        }
