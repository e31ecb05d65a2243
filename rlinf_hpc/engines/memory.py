"""What training a model directory takes in memory, estimated before anything loads: its
parameter count from the safetensors headers (no tensor read), then parameters, gradients,
AdamW state and activations at a token budget.

The activation figure is an estimate, not a measurement: per micro-batch of ``T`` tokens, the
logits in fp32 three times over (values, log-softmax, gradient) and per layer ``T x (12 H +
3 I)`` values of the parameter dtype (attention projections and MLP inputs kept for the
backward), or with activation checkpointing each layer's input plus one layer's full set.

>>> m = estimate_training_memory(10**9, 1000, 2000, 100_000, 4, 2, tokens=1000, checkpointing=False)
>>> round(m.parameters / 2**30, 2), round(m.optimizer / 2**30, 2)
(1.86, 3.73)
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30

#: Bytes of each safetensors dtype name.
DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}


def safetensors_parameters(directory: str | Path) -> int:
    """Elements of every tensor in the directory's ``*.safetensors`` files, read from their
    headers (8 bytes of length, then JSON): nothing is loaded."""
    total = 0
    for path in sorted(Path(directory).expanduser().glob("*.safetensors")):
        with path.open("rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
        for name, spec in header.items():
            if name != "__metadata__":
                count = 1
                for size in spec["shape"]:
                    count *= size
                total += count
    return total


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes one training rank holds (its shares where the optimizer is sharded)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations

    def describe(self) -> str:
        parts = (
            ("parameters", self.parameters), ("gradients", self.gradients),
            ("optimizer", self.optimizer), ("activations", self.activations),
        )  # fmt: skip
        return f"{self.total / GIB:.1f} GiB (" + ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts) + ")"


def estimate_training_memory(
    num_parameters: int,
    hidden_size: int,
    intermediate_size: int,
    vocab_size: int,
    num_layers: int,
    dtype_bytes: int,
    tokens: int,
    checkpointing: bool,
    optimizer_shards: int = 1,
    gradient_shards: int = 1,
) -> TrainingMemory:
    """One rank's memory to train with AdamW (two moments in the parameter dtype; ZeRO's
    fp32 master copy counted in the optimizer share), ``tokens`` per forward."""
    parameters = num_parameters * dtype_bytes
    gradients = parameters // gradient_shards
    moments = 2 * parameters
    master = num_parameters * 4 if dtype_bytes < 4 and optimizer_shards > 1 else 0
    optimizer = (moments + master) // optimizer_shards
    logits = 3 * tokens * vocab_size * 4
    per_layer = tokens * (12 * hidden_size + 3 * intermediate_size) * dtype_bytes
    layers = (
        (num_layers * tokens * hidden_size * dtype_bytes + per_layer)
        if checkpointing
        else num_layers * per_layer
    )
    return TrainingMemory(parameters, gradients, optimizer, logits + layers)
