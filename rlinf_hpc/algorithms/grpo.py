"""GRPO: group-normalized advantages and the clipped policy loss with an optional KL penalty.

Advantages: for the ``G`` samples of one prompt with rewards ``r``,
``A_i = (r_i - mean(r)) / (std(r) + eps)`` (``std`` unbiased, as in the GRPO paper); a group
whose samples all scored the same has ``A = 0`` and teaches nothing.

Loss per completion token ``t`` with ratio ``rho = exp(logp - logp_old)``::

    L_t = -min(rho * A, clip(rho, 1 - eps, 1 + eps) * A) + beta * KL_t
    KL_t = exp(logp_ref - logp) - (logp_ref - logp) - 1          (the k3 estimator, >= 0)

averaged over all completion tokens of the batch.

>>> group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]])).tolist()
[[0.8660..., -0.8660..., -0.8660..., 0.8660...]]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``rewards``: [prompts, group_size] -> advantages of the same shape."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(
            f"group_advantages needs rewards shaped [prompts, group_size >= 2], got {tuple(rewards.shape)}"
        )
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    return (rewards - mean) / (std + eps)


@dataclass
class LossStats:
    loss: float
    policy_loss: float
    kl: float
    clip_fraction: float
    tokens: int


def grpo_loss(
    logprobs: list[torch.Tensor],
    old_logprobs: list[torch.Tensor],
    advantages: torch.Tensor,
    clip_eps: float,
    ref_logprobs: list[torch.Tensor] | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, LossStats]:
    """The loss over a batch of completions (lists of per-token log-probs, one per sample)."""
    if not logprobs:
        raise ValueError("grpo_loss needs at least one completion")
    lengths = [len(x) for x in logprobs]
    logp = torch.cat(logprobs)
    old = torch.cat(old_logprobs).to(logp.dtype)
    adv = torch.repeat_interleave(advantages.to(logp.dtype), torch.tensor(lengths))
    ratio = torch.exp(logp - old)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    policy_loss = per_token.mean()
    kl = torch.zeros((), dtype=logp.dtype)
    if ref_logprobs is not None and kl_coef > 0:
        delta = torch.cat(ref_logprobs).to(logp.dtype) - logp
        kl = (torch.exp(delta) - delta - 1.0).mean()
    loss = policy_loss + kl_coef * kl
    clip_fraction = ((ratio - 1.0).abs() > clip_eps).float().mean().item()
    return loss, LossStats(loss.item(), policy_loss.item(), kl.item(), clip_fraction, len(logp))
