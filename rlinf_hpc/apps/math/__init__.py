"""The `math_grpo` app: LLM reasoning (arithmetic or GSM8K-style problems, a rule-based
verifier) trained with GRPO or PPO over rollout, reward, inference, (critic) and actor
components. Its sections: [task], [model], [sft], [grpo] (`rlinf_hpc.apps.math.config`)."""

from rlinf_hpc.apps.math.config import GRPOConfig, ModelConfig, SFTConfig, TaskConfig, check_batches
from rlinf_hpc.config.apps import App

APP = App(
    name="math_grpo",
    flow="rlinf_hpc.apps.math.flow:math_grpo_flow",
    validate="rlinf_hpc.apps.math.checks:validate",
    sections={"task": TaskConfig, "model": ModelConfig, "sft": SFTConfig, "grpo": GRPOConfig},
    check=check_batches,
    resumable_keys=("grpo.steps", "grpo.eval_every", "grpo.tensorboard"),
    fixed_keys=("model.", "task.", "grpo.train_backend", "grpo.group_size", "grpo.algorithm"),
    description="LLM reasoning with GRPO or PPO (warm start, rollout, reward, log-probs, update)",
)
