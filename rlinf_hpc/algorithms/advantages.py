"""Advantages: GRPO's group-relative outcome advantage and GAE with a critic.

GRPO (outcome reward ``s_i`` = the sum of a response's token rewards; ``g(i)`` its prompt)::

    A_i = (s_i - mean_g(s)) / (std_g(s) + eps)      (std unbiased; Dr.GRPO: no division)

broadcast over the response's tokens. A group of one sample has mean 0 and std 1 (veRL's
convention); a group whose samples all scored the same gets exactly 0 (computed in float64, so
16 x 0.1 in float32 does not leave a rounding residue divided by a tiny std).

GAE (per token ``t`` of a response, ``V`` the critic's values, ``r`` token rewards)::

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}       (V_{T} = A_{T} = 0 past the end)
    R_t     = A_t + V_t                             (the value target)

masked tokens are skipped (their value and TD error do not enter the recursion); the
advantages are then whitened over the masked tokens of the batch.

GAE over environment transitions (``[T, n]``: step ``t`` of env ``i``; ``V(s'_t)`` the value of
the observation the step led to — for a truncated episode its final observation, not the reset
one)::

    delta_t = r_t + gamma * (1 - terminated_t) * V(s'_t) - V(s_t)
    A_t     = delta_t + gamma * lam * (1 - done_t) * A_{t+1}     (done = terminated or truncated)

so a time limit bootstraps from the value of where the episode stopped (it did not end there), a
termination does not, and neither lets the recursion run into the next episode.

>>> adv, _ = grpo_outcome_advantage(torch.tensor([[1.0], [0.0], [0.5], [0.5]]),
...                                 torch.ones(4, 1), ["a", "a", "b", "b"])
>>> [round(a, 4) for a in adv.flatten().tolist()]
[0.7071, -0.7071, 0.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from rlinf_hpc.algorithms.aggregation import masked_whiten


def grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[batch, T]`` rewards, mask and one group id per row -> (advantages, returns), both
    ``[batch, T]`` (equal, as GRPO has no critic)."""
    scores = token_level_rewards.sum(dim=-1).double()
    ids: dict[Hashable, int] = {}
    group = torch.tensor([ids.setdefault(key, len(ids)) for key in index], dtype=torch.long)
    if len(group) != len(scores):
        raise ValueError(f"index has {len(group)} entries for {len(scores)} responses")
    count = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, group, torch.ones_like(scores))
    mean = torch.zeros_like(count).index_add_(0, group, scores) / count
    squares = torch.zeros_like(count).index_add_(0, group, (scores - mean[group]) ** 2)
    std = (squares / (count - 1).clamp(min=1)).sqrt()
    single = count == 1
    mean, std = torch.where(single, 0.0, mean), torch.where(single, 1.0, std)
    denominator = std + epsilon
    # veRL's singleton std is a float32 1.0, so its 1 + eps is rounded to float32: kept, so the
    # two agree to the last bit in float64 too
    denominator = torch.where(single, float(torch.tensor(1.0) + epsilon), denominator)
    low = torch.full_like(count, float("inf")).scatter_reduce_(0, group, scores, "amin")
    high = torch.full_like(count, -float("inf")).scatter_reduce_(0, group, scores, "amax")
    uniform = (low == high) & ~single
    centred = torch.where(uniform[group], 0.0, scores - mean[group])
    advantage = centred / denominator[group] if norm_adv_by_std else centred
    out = advantage.to(token_level_rewards.dtype).unsqueeze(-1) * response_mask
    return out, out


def gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[batch, T]`` token rewards, critic values and mask -> (advantages, returns)."""
    with torch.no_grad():
        mask = response_mask.to(values.dtype)
        next_value = torch.zeros_like(values[:, 0])
        running = torch.zeros_like(values[:, 0])
        reversed_advantages = []
        for t in reversed(range(values.shape[-1])):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            candidate = delta + gamma * lam * running
            next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
            running = candidate * mask[:, t] + (1 - mask[:, t]) * running
            reversed_advantages.append(running)
        advantages = torch.stack(reversed_advantages[::-1], dim=1)
        returns = advantages + values
        if whiten:
            advantages = masked_whiten(advantages, mask)
    return advantages, returns


def outcome_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """A scalar reward per response placed on its last unmasked token (zeros elsewhere): the
    token-level rewards of an outcome-supervised task, for GAE."""
    rewards = torch.zeros_like(response_mask, dtype=scores.dtype)
    last = response_mask.sum(dim=-1).long().clamp(min=1) - 1
    rewards[torch.arange(len(scores)), last] = scores
    return rewards


def gae_transitions(
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_values: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    gamma: float = 0.99,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, n]`` rewards, V(s_t), V(s'_t), 0/1 terminated and truncated -> (advantages,
    returns), both ``[T, n]`` (not whitened).

    >>> r, v, no = torch.ones(3, 1), torch.zeros(3, 1), torch.zeros(3, 1)
    >>> ends = torch.tensor([[0.0], [1.0], [0.0]])  # the episode stops after step 1
    >>> nv = torch.tensor([[0.0], [10.0], [0.0]])  # V(s'_1) = 10 there
    >>> gae_transitions(r, v, nv, ends, no, 1.0, 1.0)[0].flatten().tolist()  # terminated
    [2.0, 1.0, 1.0]
    >>> gae_transitions(r, v, nv, no, ends, 1.0, 1.0)[0].flatten().tolist()  # truncated: bootstrap
    [12.0, 11.0, 1.0]
    """
    with torch.no_grad():
        keep = 1.0 - terminated.to(values.dtype)
        cont = 1.0 - torch.maximum(terminated, truncated).to(values.dtype)
        deltas = rewards + gamma * keep * next_values - values
        advantages = torch.zeros_like(values)
        running = torch.zeros_like(values[0])
        for t in reversed(range(values.shape[0])):
            running = deltas[t] + gamma * lam * cont[t] * running
            advantages[t] = running
    return advantages, advantages + values
