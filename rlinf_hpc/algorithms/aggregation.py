"""Masked reductions over ``[batch, response_length]`` tensors and the loss aggregations.

Everything here works on right-padded token matrices with a 0/1 ``mask`` (veRL's layout), so a
loss is written once and aggregated any of four ways (``loss_agg_mode``):

- ``token-mean``: ``sum(L * m) / sum(m)`` — every token weighs the same (DAPO; the default);
- ``seq-mean-token-sum``: ``mean_i sum_t L_it m_it``;
- ``seq-mean-token-mean``: ``mean_i (sum_t L_it m_it / sum_t m_it)`` — every sequence weighs the
  same (the GRPO paper);
- ``seq-mean-token-sum-norm``: ``mean_i sum_t L_it m_it / T`` with ``T`` the padded length —
  Dr.GRPO's constant normalizer (pad to the generation budget to keep ``T`` fixed).

Sequences without any unmasked token do not count in the ``seq-mean`` modes; denominators
carry veRL's ``+ 1e-8`` (veRL 0.9's ``agg_loss``, same results to rounding).

Data parallel: with ``dp`` (`DataParallelScale`) a rank's aggregate is its share of the
*global* one — ``token-mean`` divides by the token count of all ranks, the other ``seq-mean``
modes by their sequence count — times the rank count, which the gradient average over ranks cancels. So
several actor ranks optimize exactly what one rank would on the whole batch.

>>> loss = torch.tensor([[1.0, 3.0], [2.0, 0.0]]); mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
>>> [round(agg_loss(loss, mask, m).item(), 6) for m in LOSS_AGG_MODES]
[2.0, 3.0, 2.0, 1.5]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class DataParallelScale:
    """Counts over every data-parallel rank of this (mini)batch, and the number of ranks."""

    tokens: float
    sequences: float
    ranks: int


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(v * m) / (sum(m) + 1e-8)`` (0 for an empty mask, not NaN)."""
    return masked_sum(values, mask) / (mask.sum() + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries (Bessel-corrected when ``unbiased``)."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count < 2:
            raise ValueError(
                f"an unbiased masked variance needs at least two unmasked entries, got {int(count)} "
                "(use a larger batch)"
            )
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``(v - mean) / sqrt(var + 1e-8)`` over the masked entries; the mean is added back when
    ``shift_mean`` is False."""
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + 1e-8)
    return whitened if shift_mean else whitened + mean


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    dp: DataParallelScale | None = None,
) -> torch.Tensor:
    """The scalar loss of a ``[batch, T]`` token loss matrix (modes in the module docstring)."""
    mask = loss_mask.to(loss_mat.dtype)
    token_sums = (loss_mat * mask).sum(dim=-1)
    if loss_agg_mode == "token-mean":
        tokens = mask.sum() if dp is None else dp.tokens
        return token_sums.sum() / tokens * (1 if dp is None else dp.ranks)
    counts = mask.sum(dim=-1)
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        per_sequence = token_sums
    elif loss_agg_mode == "seq-mean-token-mean":
        per_sequence = token_sums / (counts + 1e-8)
    else:
        raise ValueError(f"loss_agg_mode {loss_agg_mode!r} is not one of {', '.join(LOSS_AGG_MODES)}")
    present = (counts > 0).to(loss_mat.dtype)  # a fully masked sequence does not count
    sequences = present.sum() if dp is None else dp.sequences
    loss = (per_sequence * present).sum() / sequences * (1 if dp is None else dp.ranks)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / loss_mask.shape[-1]
    return loss


def pad_right(rows: Sequence[torch.Tensor], length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length 1-D tensors -> ``([n, T] values, [n, T] 0/1 mask)``, padded with zeros
    to ``length`` (default: the longest row). Gradients flow through the values."""
    width = max([len(r) for r in rows] + [length or 0, 1])
    if not rows:
        return torch.zeros(0, width), torch.zeros(0, width)
    dtype = rows[0].dtype
    values = torch.stack([torch.nn.functional.pad(r.to(dtype), (0, width - len(r))) for r in rows])
    mask = torch.zeros(len(rows), width, dtype=dtype)
    for i, r in enumerate(rows):
        mask[i, : len(r)] = 1
    return values, mask
