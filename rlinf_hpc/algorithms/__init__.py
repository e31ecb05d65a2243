"""RL algorithms — the one home of advantages, policy and value losses, KL and aggregation.

One module per concept, each function short and documented with its formula (as CleanRL
writes them), with veRL's semantics and names (``core_algos``): `advantages` (GRPO outcome
advantage, GAE over tokens and over env transitions), `policy_loss` (PPO clip with clip-higher
and dual clip), `value_loss` (clipped value loss, entropy), `kl` (k1/abs/k2/k3), `aggregation`
(masked reductions, the four ``loss_agg_mode``\\ s, data-parallel normalization), `normalization`
(running mean and variance for observation and reward normalization). Tensors are
``[batch, response_length]`` with a 0/1 response mask.
"""

from rlinf_hpc.algorithms.advantages import (
    gae_advantage_return,
    gae_transitions,
    grpo_outcome_advantage,
    outcome_token_rewards,
)
from rlinf_hpc.algorithms.aggregation import (
    LOSS_AGG_MODES,
    DataParallelScale,
    agg_loss,
    masked_mean,
    masked_var,
    masked_whiten,
    pad_right,
)
from rlinf_hpc.algorithms.kl import KL_ESTIMATORS, kl_penalty
from rlinf_hpc.algorithms.normalization import RunningMeanStd
from rlinf_hpc.algorithms.policy_loss import PolicyLossMetrics, ppo_policy_loss
from rlinf_hpc.algorithms.value_loss import clipped_value_loss, entropy_from_logits

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "DataParallelScale",
    "PolicyLossMetrics",
    "RunningMeanStd",
    "agg_loss",
    "clipped_value_loss",
    "entropy_from_logits",
    "gae_advantage_return",
    "gae_transitions",
    "grpo_outcome_advantage",
    "kl_penalty",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "outcome_token_rewards",
    "pad_right",
    "ppo_policy_loss",
]
