"""The critic's clipped value loss (PPO) and the policy's entropy.

Value loss per token, with ``V_old`` the values the advantages were computed with and ``R``
the GAE returns::

    V_clip = clip(V, V_old - c, V_old + c)
    L      = 0.5 * max((V - R)^2, (V_clip - R)^2)

aggregated with `agg_loss`; ``vf_clipfrac`` is the share of tokens where the clipped term is
the larger one. Entropy of a categorical from logits: ``H = logsumexp(z) - sum softmax(z) z``.

>>> loss, frac = clipped_value_loss(torch.tensor([[2.0]]), torch.tensor([[0.0]]),
...                                 torch.tensor([[1.0]]), torch.ones(1, 1), 0.5)
>>> loss.item(), frac.item()  # V_clip = 1.5: 0.5 * max(4, 2.25)
(2.0, 0.0)
"""

from __future__ import annotations

import torch

from rlinf_hpc.algorithms.aggregation import DataParallelScale, agg_loss, masked_mean


def clipped_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp: DataParallelScale | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[batch, T]`` new values, returns, old values, mask -> (scalar loss, vf_clipfrac)."""
    clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    plain_error = (vpreds - returns) ** 2
    clipped_error = (clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(plain_error, clipped_error), response_mask, loss_agg_mode, dp)
    with torch.no_grad():
        clipfrac = masked_mean(torch.gt(clipped_error, plain_error).to(vpreds.dtype), response_mask)
    return loss, clipfrac


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dimension."""
    probabilities = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probabilities * logits).sum(dim=-1)
