"""The emulated workload's config section: [emulation] (which cost profile, how fast)."""

from __future__ import annotations

from pydantic import Field, field_validator

from rlinf_hpc.config.section import Section


class EmulationConfig(Section):
    """[emulation]: stages that *sleep* what a real device would spend (`profiles.PROFILES`),
    so 8-32 ranks fit on a small box without competing for its cores."""

    profile: str = Field(
        "grpo-7b",
        description="Cost profile: grpo-7b, grpo-1.5b, grpo-32b (long-tailed generation), embodied "
        "(CPU simulators, policy and actor on devices), or the path of a .toml profile of your own "
        "(apps/emulated/profile_file.py; relative to the launch directory). The components must be "
        "the profile's stages.",
    )
    time_scale: float = Field(
        0.01, gt=0, le=1, description="Seconds slept per emulated second (0.01: a 300 s step in 3 s)."
    )
    steps: int = Field(6, ge=1, description="RL steps.")
    off_policy_steps: int = Field(
        0,
        ge=0,
        le=1,
        description="`1`: the training stages (the profile's trainers: the actor, and a critic after "
        "it if the profile has one) train on step t's samples while the other stages already produce "
        "step t+1's (one-step off-policy); `0`: on-policy.",
    )
    continuous_generation: bool = Field(
        True,
        description="`true`: the rollout stage is one continuous-batching engine per rank for the "
        "whole step (requests join as slots free; the long tail is paid once per step); `false`: "
        "one generate call per micro-batch, each waiting on its longest response.",
    )
    partial_rollouts: float = Field(
        0.0,
        ge=0,
        le=0.5,
        description="Partial rollouts (with continuous_generation): a rollout engine whose step "
        "input has ended stops once at most this fraction of the requests it admitted in the step "
        "still decode, and goes on with them first in its next step. 0: every response ends in its "
        "own step (the engine waits for its longest one).",
    )
    partial_rollout_steps: int = Field(
        2,
        ge=2,
        le=8,
        description="With partial_rollouts: the most steps a response may span (it is finished in "
        "its last one, however long it still is), so its first tokens are at most this minus one "
        "updates stale.",
    )
    samples_per_step: int | None = Field(
        None, ge=1, description="Responses (or transitions) per step; default: the profile's."
    )

    @field_validator("profile")
    @classmethod
    def _known(cls, value: str) -> str:
        from pathlib import Path

        from rlinf_hpc.apps.emulated.profile_file import get_profile

        get_profile(value)  # a ProfileError (a ValueError) says what is wrong
        # a file by its absolute path: every rank reads it, wherever it starts
        return value if not value.endswith(".toml") else str(Path(value).expanduser().resolve())
