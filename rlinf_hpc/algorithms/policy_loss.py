"""The PPO clipped policy objective with clip-higher and dual clip (used by GRPO and PPO).

Per token, with ``rho = exp(clamp(logp - logp_old, -20, 20))`` and advantage ``A``::

    L1 = -A * rho
    L2 = -A * clip(rho, 1 - eps_low, 1 + eps_high)      (clip-higher: eps_high > eps_low, DAPO)
    L  = max(L1, L2)                                     (the PPO clip)
    L  = min(L, -A * c)      where A < 0                 (dual clip: bounds the loss of a
                                                          negative-advantage token whose ratio
                                                          ran away, c > 1; Ye et al. 2019)

aggregated with `agg_loss`. Metrics, as veRL defines them (means over the masked tokens):
``pg_clipfrac`` — share of tokens where the clipped branch is active (``L2 > L1``);
``pg_clipfrac_lower`` — share where the dual clip is (``A < 0`` and ``L > -A c``);
``ppo_kl`` — ``mean(logp_old - logp)``, the sampled KL(old || new).

>>> loss, m = ppo_policy_loss(torch.tensor([[-0.5]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]),
...                           torch.ones(1, 1), 0.2, 0.2)
>>> round(loss.item(), 4), m.pg_clipfrac.item()  # rho = e^0.5 > 1.2: clipped at -1.2
(-1.2, 1.0)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlinf_hpc.algorithms.aggregation import DataParallelScale, agg_loss, masked_mean


@dataclass
class PolicyLossMetrics:
    pg_clipfrac: torch.Tensor
    pg_clipfrac_lower: torch.Tensor
    ppo_kl: torch.Tensor


def ppo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    dp: DataParallelScale | None = None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """``[batch, T]`` tensors -> (scalar loss, metrics)."""
    if clip_ratio_c <= 1.0:
        raise ValueError(f"the dual-clip bound clip_ratio_c must be > 1, got {clip_ratio_c}")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    ppo_clipped = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    dual_clipped = torch.minimum(ppo_clipped, dual_bound)
    negative = advantages < 0
    per_token = torch.where(negative, dual_clipped, ppo_clipped)
    with torch.no_grad():
        metrics = PolicyLossMetrics(
            pg_clipfrac=masked_mean(torch.gt(clipped, unclipped).to(ratio.dtype), response_mask),
            pg_clipfrac_lower=masked_mean(
                (torch.gt(ppo_clipped, dual_bound) & negative).to(ratio.dtype), response_mask
            ),
            ppo_kl=masked_mean(-log_ratio, response_mask),
        )
    return agg_loss(per_token, response_mask, loss_agg_mode, dp), metrics
