"""The embodied policy: an actor-critic MLP over flat observations.

Discrete actions: a categorical over logits. Continuous actions: a diagonal Gaussian with a
state-independent log std, sampled unbounded and clipped to the action bounds by the env
worker (the log-prob is the Gaussian's, as CleanRL and most PPO baselines do).

Sampling takes its randomness from the caller (``noise``: uniforms for a categorical, standard
normals for a Gaussian): the env rank that asks draws it from its own seeded generator, so an
action does not depend on which policy rank served the request — runs are reproducible and
resume exactly under any load balance.

With ``obs_clip`` set, observations are standardized by running statistics (`RunningMeanStd`
buffers, updated by the actor after each update and sent to the policy ranks with the weights)
and clipped to ``[-obs_clip, obs_clip]`` before both networks.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from rlinf_hpc.algorithms import RunningMeanStd
from rlinf_hpc.apps.embodied.envs import Spec, check_env_id


def _mlp(sizes: list[int], out: int, out_gain: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [_init(nn.Linear(a, b), math.sqrt(2)), nn.Tanh()]
    layers.append(_init(nn.Linear(sizes[-1], out), out_gain))
    return nn.Sequential(*layers)


def _init(layer: nn.Linear, gain: float) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class ActorCritic(nn.Module):
    """``policy(obs) -> logits or mean``, ``value(obs) -> [n]``; ``obs_clip``: normalize
    observations (see the module docstring)."""

    def __init__(self, spec: Spec, hidden: list[int], obs_clip: float | None = None) -> None:
        super().__init__()
        self.discrete = spec.discrete
        self.obs_clip = obs_clip or 0.0  # used only with obs_rms
        self.obs_rms = RunningMeanStd(spec.obs_dim) if obs_clip is not None else None
        sizes = [spec.obs_dim, *hidden]
        self.actor = _mlp(sizes, spec.action_dim, 0.01)
        self.critic = _mlp(sizes, 1, 1.0)
        if not spec.discrete:
            self.log_std = nn.Parameter(torch.zeros(spec.action_dim))

    def inputs(self, obs: torch.Tensor) -> torch.Tensor:
        """What the networks see of raw observations (standardized and clipped, if normalized)."""
        if self.obs_rms is None:
            return obs
        return self.obs_rms.normalize(obs, self.obs_clip)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(self.inputs(obs)).squeeze(-1)

    def log_prob_entropy(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probability of ``actions`` and the distribution's entropy, per row."""
        out = self.actor(self.inputs(obs))
        if self.discrete:
            logp = torch.log_softmax(out, dim=-1)
            chosen = logp.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
            entropy = -(logp.exp() * logp).sum(-1)
            return chosen, entropy
        std = self.log_std.exp()
        z = (actions - out) / std
        logp = (-0.5 * z**2 - self.log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        entropy = (0.5 + 0.5 * math.log(2 * math.pi) + self.log_std).sum().expand(len(obs))
        return logp, entropy

    @torch.no_grad()
    def act(
        self, obs: torch.Tensor, noise: torch.Tensor, greedy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Actions sampled with the caller's ``noise`` (``[n]`` uniforms or ``[n, d]``
        normals), and their log-probabilities.

        One forward pass: a Gaussian action's standardized offset *is* the noise, so its
        log-prob comes from the noise (it equals `log_prob_entropy`'s to rounding, ~1e-7)."""
        out = self.actor(self.inputs(obs))
        if self.discrete:
            probs = torch.softmax(out, dim=-1)
            if greedy:
                actions = probs.argmax(-1)
            else:
                cdf = probs.cumsum(-1)
                actions = torch.searchsorted(cdf, noise.unsqueeze(-1).to(cdf.dtype) * cdf[:, -1:]).squeeze(-1)
                actions = actions.clamp(max=out.shape[-1] - 1)
            logp = torch.log_softmax(out, dim=-1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)
            return actions, logp
        if greedy:
            noise = torch.zeros_like(out)
        actions = out + self.log_std.exp() * noise
        logp = (-0.5 * noise**2 - self.log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        return actions, logp


def build_model(config: Any) -> ActorCritic:
    """The job's policy as its config says (env spec, hidden sizes, observation normalization),
    from the job seed's initial weights: every policy and actor rank starts from the same ones."""
    spec = check_env_id(config.env.id, config.env.options)
    torch.manual_seed(config.job.seed)
    ppo = config.ppo
    return ActorCritic(spec, list(ppo.hidden_sizes), ppo.obs_clip if ppo.normalize_observations else None)
