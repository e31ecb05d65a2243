"""Running mean and variance of a stream of batches: observation and reward normalization.

PPO on MuJoCo-like tasks learns several times faster with observations standardized by their
running statistics and rewards scaled by the running standard deviation of the discounted return
(the ``NormalizeObservation`` / ``NormalizeReward`` wrappers every PPO baseline uses). Here the
statistics are a module's buffers rather than a per-process wrapper's: the actor updates them, they
travel to the policy ranks with the weights (`workers.weights` sends persistent buffers) and into
checkpoints with the model, and data-parallel actor ranks merge their batches with one all-reduce —
so every rank normalizes with the same figures at a given weight version. gymnasium's
``RunningMeanStd`` is NumPy state inside a wrapper on one process, which gives none of that.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class RunningMeanStd(nn.Module):
    """Mean and variance over every row seen so far (``update``), merged batch by batch with
    Chan et al.'s parallel formula in float64; ``normalize`` standardizes and clips.

    >>> rms = RunningMeanStd(1)
    >>> rms.update(torch.tensor([[1.0], [3.0]]))
    >>> rms.update(torch.tensor([[5.0]]))
    >>> round(float(rms.mean), 3), round(float(rms.var), 3), int(rms.count)
    (3.0, 2.667, 3)
    """

    def __init__(self, size: int, epsilon: float = 1e-8) -> None:
        super().__init__()
        self.epsilon = epsilon
        self.register_buffer("mean", torch.zeros(size, dtype=torch.float64))
        self.register_buffer("var", torch.ones(size, dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    @torch.no_grad()
    def update(self, rows: torch.Tensor, reduce: bool = True) -> None:
        """Merge ``rows`` (``[n, size]``, or ``[n]`` for size 1) into the statistics; with
        ``reduce`` and a torch.distributed group, every member's rows (the group's sum)."""
        rows = rows.detach().to(torch.float64).reshape(-1, self.mean.numel())
        n = torch.tensor([float(len(rows))], dtype=torch.float64)
        total, squares = rows.sum(0), (rows * rows).sum(0)
        if reduce and dist.is_initialized() and dist.get_world_size() > 1:
            packed = torch.cat([n, total, squares])
            dist.all_reduce(packed)
            n, total, squares = packed[:1], packed[1 : 1 + len(total)], packed[1 + len(total) :]
        count = float(n)
        if count == 0:
            return
        mean = total / count
        var = (squares / count - mean * mean).clamp(min=0.0)
        merged = self.count + count
        delta = mean - self.mean
        self.var.copy_(
            (self.var * self.count + var * count + delta * delta * self.count * count / merged) / merged
        )
        self.mean.add_(delta * count / merged)
        self.count.fill_(float(merged))

    def std(self) -> torch.Tensor:
        """``sqrt(var + eps)``: what `normalize` and `scale` divide by (float64)."""
        return torch.sqrt(self.var + self.epsilon)

    def normalize(self, x: torch.Tensor, clip: float) -> torch.Tensor:
        """``(x - mean) / sqrt(var + eps)`` clipped to ``[-clip, clip]``, in ``x``'s dtype."""
        return ((x - self.mean.to(x.dtype)) / self.std().to(x.dtype)).clamp(-clip, clip)

    def scale(self, x: torch.Tensor, clip: float) -> torch.Tensor:
        """``x / sqrt(var + eps)`` clipped (reward scaling: the mean is not subtracted)."""
        return (x / self.std().to(x.dtype)).clamp(-clip, clip)
