"""The embodied app's config sections: [env] (the simulators) and [ppo] (the policy, its
training and how rollouts and updates overlap)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlinf_hpc.config.section import Section


class EnvConfig(Section):
    """[env]: simulators on CPU, a batch of them on each rank of [components.env]."""

    id: str = Field(
        "CartPole-v1",
        description="A registered gymnasium environment id (classic control such as "
        "CartPole-v1; MuJoCo tasks such as Hopper-v5 or HalfCheetah-v5 need the `mujoco` package).",
    )
    envs_per_rank: int = Field(16, ge=1, le=4096, description="Simulator instances on each env rank.")
    pipeline_stages: int = Field(
        2,
        ge=1,
        le=64,
        description="Groups each env rank splits its instances into: while one group steps, the "
        "policy ranks compute the actions of another (1: no pipelining, the env waits for every "
        "action). Must divide envs_per_rank.",
    )
    max_episode_steps: int | None = Field(
        None, ge=1, description="Time limit (truncation) instead of the environment's registered one."
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of gymnasium.make (e.g. { ctrl_cost_weight = 0.1 }).",
    )

    @model_validator(mode="after")
    def _check_stages(self) -> EnvConfig:
        if self.envs_per_rank % self.pipeline_stages:
            raise ValueError(
                f"env.envs_per_rank = {self.envs_per_rank} cannot be split into "
                f"env.pipeline_stages = {self.pipeline_stages} equal groups; make envs_per_rank "
                "a multiple of pipeline_stages"
            )
        return self


class PPOConfig(Section):
    """[ppo]: an actor-critic MLP trained with PPO (GAE, clipped objective, value loss, entropy)."""

    iterations: int = Field(60, ge=1, description="Rollout + update iterations.")
    rollout_steps: int = Field(64, ge=1, description="Steps of every simulator instance per rollout.")
    hidden_sizes: list[int] = Field(
        default_factory=lambda: [64, 64], description="Hidden layers of the policy and value MLPs (tanh)."
    )
    lr: float = Field(2.5e-3, gt=0, description="Adam learning rate (annealed linearly to 0 when anneal_lr).")
    anneal_lr: bool = Field(True, description="Anneal the learning rate linearly over the iterations.")
    gamma: float = Field(0.99, ge=0, le=1, description="Discount.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    epochs: int = Field(4, ge=1, le=64, description="Passes over each rollout.")
    minibatches: int = Field(4, ge=1, description="Optimizer steps per pass (per actor rank).")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO ratio clip.")
    clip_value: float = Field(0.2, gt=0, description="Value clip around the behaviour values.")
    vf_coef: float = Field(0.5, ge=0, description="Weight of the value loss.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight.")
    max_grad_norm: float = Field(0.5, gt=0, description="Gradient norm clip.")
    normalize_advantages: bool = Field(True, description="Whiten advantages in each minibatch.")
    normalize_observations: bool = Field(
        False,
        description="Standardize observations by their running mean and variance, clipped to "
        "+-obs_clip, before the policy and value networks (the statistics are the model's: the "
        "actor updates them after each update, the policy ranks get them with the weights). "
        "What PPO baselines do for MuJoCo tasks; classic control learns without it.",
    )
    obs_clip: float = Field(10.0, gt=0, description="Clip of normalized observations.")
    normalize_rewards: bool = Field(
        False,
        description="Divide rewards by the running standard deviation of the discounted return "
        "(each simulator's, tracked on its env rank), clipped to +-reward_clip, for GAE and the "
        "value targets; reported returns stay the environment's. What PPO baselines do for "
        "MuJoCo tasks.",
    )
    reward_clip: float = Field(10.0, gt=0, description="Clip of scaled rewards.")
    async_updates: bool = Field(
        False,
        description="Collect rollout k+1 with the weights rollout k was collected with while the "
        "actor trains on rollout k (one update stale, importance-corrected with the behaviour "
        "policy's log-probs: `decoupled_loss`). The actor needs ranks of its own for the two to "
        "overlap.",
    )
    decoupled_loss: bool = Field(
        True,
        description="With async_updates: clip each update around the weights it starts from "
        "(the proximal policy; one no-grad forward of the rollout) and weight each transition by "
        "proximal / behaviour probability — the decoupled PPO objective (AReaL). `false`: clip "
        "around the behaviour policy's log-probs. A rollout collected with the trained weights "
        "(staleness 0) takes the plain objective either way.",
    )
    behaviour_weight_cap: float = Field(
        5.0,
        gt=1,
        description="Decoupled loss: transitions whose proximal / behaviour probability exceeds "
        "this are left out.",
    )
    max_staleness: int = Field(
        1, ge=0, le=1, description="Largest allowed gap (updates) between behaviour and trained weights."
    )
    policy_batching: Literal["request", "merge"] = Field(
        "request",
        description="`request`: one forward pass per env request (results do not depend on which "
        "requests arrived together: a seed gives the same run bit for bit); `merge`: one pass "
        "over every waiting request (fewer, larger passes — for accelerators — but the float "
        "rounding of a row then depends on the batch it came in, so runs differ in the last bits "
        "and continuous-control trajectories drift apart).",
    )
    policy_batch: int = Field(
        4096, ge=1, description="Most observations a policy rank takes from the channel at once."
    )
