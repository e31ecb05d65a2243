"""Per-token KL estimators between the policy and a reference policy (Schulman's k1/k2/k3).

With ``d = logp - logp_ref`` (log-probs of the sampled token):

- ``k1`` (alias ``kl``): ``d`` — unbiased, can be negative;
- ``abs``: ``|d|``;
- ``k2`` (alias ``mse``): ``d^2 / 2``;
- ``k3`` (alias ``low_var_kl``): ``exp(-d) + d - 1`` — unbiased for KL(pi || ref) under
  samples of pi, never negative; ``-d`` is clamped to [-20, 20] before the exponential and
  the result to [-10, 10], as veRL does, so one extreme token cannot blow up a run.

>>> logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
>>> [round(kl_penalty(logp, ref, e).item(), 4) for e in ("k1", "abs", "k2", "k3")]
[0.5, 0.5, 0.125, 0.1065]
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "abs", "k2", "k3")
ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Token-wise estimate of KL(policy || reference), same shape as ``logprob``."""
    name = ALIASES.get(estimator, estimator)
    diff = logprob - ref_logprob
    if name == "k1":
        return diff
    if name == "abs":
        return diff.abs()
    if name == "k2":
        return 0.5 * diff.square()
    if name == "k3":
        log_ratio = torch.clamp(-diff, min=-20.0, max=20.0)  # log(ref / policy)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, min=-10.0, max=10.0)
    raise ValueError(f"kl estimator {estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")
