"""RL algorithms: advantages and losses."""

from rlinf_hpc.algorithms.grpo import LossStats, group_advantages, grpo_loss

__all__ = ["LossStats", "group_advantages", "grpo_loss"]
