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

**Decoupled objective** (off-policy samples; Hilton et al. 2021, "Batch size-invariance for
policy optimization", as AReaL trains asynchronously): with ``proximal_log_prob`` given — a
recent policy (the weights the update started from, or those a minibatch met at its first
forward in it), while ``old_log_prob`` is the *behaviour* policy that sampled the tokens, some
updates older — the trust region is taken around the proximal policy (``rho = pi / pi_prox``)
and each token's loss is weighted by the detached importance weight ``w = pi_prox /
pi_behav``; tokens whose ``w`` exceeds ``behaviour_weight_cap`` are dropped (weight 0; they
still count in the aggregation's denominator). Any proximal policy keeps the estimate
importance-corrected as long as ``w`` uses the same one; only the trust region's centre moves.
Clipping against the behaviour policy instead (the plain objective on stale samples) starts
the update with ratios already away from 1. ``ppo_kl`` is then taken from the proximal policy;
extra metrics ``behaviour_weight`` (mean ``w`` over the kept tokens) and ``behaviour_capped``
(share dropped).

>>> loss, m = ppo_policy_loss(torch.tensor([[-0.5]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]),
...                           torch.ones(1, 1), 0.2, 0.2)
>>> round(loss.item(), 4), m.pg_clipfrac.item()  # rho = e^0.5 > 1.2: clipped at -1.2
(-1.2, 1.0)
>>> loss, m = ppo_policy_loss(torch.tensor([[-0.5]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]),
...                           torch.ones(1, 1), 0.2, 0.2, proximal_log_prob=torch.tensor([[0.0]]))
>>> round(loss.item(), 4), m.pg_clipfrac.item(), round(m.behaviour_weight.item(), 4)  # rho 1, w e^0.5
(-1.6487, 0.0, 1.6487)
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
    behaviour_weight: torch.Tensor | None = None
    behaviour_capped: torch.Tensor | None = None


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
    proximal_log_prob: torch.Tensor | None = None,
    behaviour_weight_cap: float = 5.0,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """``[batch, T]`` tensors -> (scalar loss, metrics); ``proximal_log_prob``: the decoupled
    objective (module docstring)."""
    if clip_ratio_c <= 1.0:
        raise ValueError(f"the dual-clip bound clip_ratio_c must be > 1, got {clip_ratio_c}")
    if behaviour_weight_cap <= 1.0:
        raise ValueError(f"the behaviour weight cap must be > 1, got {behaviour_weight_cap}")
    behaviour_log_prob = old_log_prob
    if proximal_log_prob is not None:
        old_log_prob = proximal_log_prob.detach()
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
    if proximal_log_prob is not None:
        with torch.no_grad():
            weight = torch.exp(torch.clamp(old_log_prob - behaviour_log_prob, min=-20.0, max=20.0))
            capped = torch.gt(weight, behaviour_weight_cap)
            weight = torch.where(capped, torch.zeros_like(weight), weight)
            kept = response_mask * (~capped).to(response_mask.dtype)
            metrics.behaviour_weight = masked_mean(weight, kept)
            metrics.behaviour_capped = masked_mean(capped.to(weight.dtype), response_mask)
        per_token = per_token * weight
    return agg_loss(per_token, response_mask, loss_agg_mode, dp), metrics
