"""[placement] and [pipeline]: how components share worker ranks, and the micro-batches of a
Pipeline's stages (the elastic micro flow)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlinf_hpc.config.section import Section as _Section


class PlacementConfig(_Section):
    """[placement]: how components share worker ranks."""

    mode: Literal["disaggregated", "collocated", "hybrid", "auto"] = Field(
        "disaggregated",
        description="`disaggregated`: every component on ranks of its own (they pipeline); "
        "`collocated`: all components on the same ranks (they take turns); `hybrid`: the "
        "components of each entry of `groups` share ranks, groups are disjoint; `auto`: start "
        "collocated on every worker rank, measure the phases of the flow's Pipeline for "
        "`auto_warmup_steps` steps, then keep collocated or split the ranks between the stages, "
        "whichever the cost model predicts faster (components' num_ranks is ignored); pipelines "
        "that run side by side (one-step off-policy's generation and training) are measured and "
        "split as one. `auto` with `groups` (for a flow that places itself, e.g. embodied PPO): "
        "each group's members start on the same ranks, as many as their num_ranks add up to, "
        "the other components on ranks of their own; the flow then keeps the group shared or "
        "splits its ranks between its members.",
    )
    groups: list[list[str]] = Field(
        default_factory=list,
        description="For `hybrid` (and `auto`'s warm-up, see `mode`): lists of components that "
        'share ranks, e.g. [["rollout", "inference"], ["actor"]]. Components in no group get '
        "ranks of their own.",
    )
    switch: Literal["full", "light", "off"] = Field(
        "full",
        description="When components share a rank, before one runs: `full` moves the others' "
        "weights, gradients and optimizer state to host memory (see `offload`); `light` only "
        "asks them to release caches (`Worker.release_caches`); `off` does nothing.",
    )
    offload: Literal["none", "plain", "byte_planes", "delta"] = Field(
        "none",
        description="How a full switch stores state in host memory: raw copies, or zstd plain, "
        "with byte planes, or as an XOR delta against the previous snapshot.",
    )
    auto_warmup_steps: int = Field(
        2,
        ge=1,
        le=100,
        description="For `auto`: pipeline steps run collocated to measure phase and switch times "
        "before the choice (the last one is measured; the first pays one-off switches).",
    )
    auto_verify_steps: int = Field(
        2,
        ge=0,
        le=100,
        description="For `auto`, after it split the ranks: steps measured there (after the first, "
        "which pays the move) before the split is kept; if their mean is not faster than the "
        "collocated warm-up's step, every component moves back to every worker rank (joining "
        "ranks take the state of one that kept it). 0: keep the prediction's choice unmeasured.",
    )


class PipelineConfig(_Section):
    """[pipeline]: micro-batches of a Pipeline's stages (the elastic micro flow)."""

    micro_batch: int = Field(
        32, ge=1, description="Items a stage takes from its input per micro-batch at the start."
    )
    min_micro_batch: int = Field(8, ge=1, description="Smallest micro-batch the elastic sizing uses.")
    max_micro_batch: int = Field(256, ge=1, description="Largest micro-batch the elastic sizing uses.")
    elastic: bool = Field(
        True,
        description="Adapt the micro-batch: halve while the downstream stage waits on this one "
        "longer than `wait_threshold_s`, double while memory use is above `memory_threshold`.",
    )
    wait_threshold_s: float = Field(
        0.05, gt=0, description="Downstream waiting longer than this per micro-batch halves it."
    )
    memory_threshold: float = Field(
        0.85,
        gt=0,
        le=1,
        description="Device memory in use (host memory on CPU ranks) above this fraction doubles "
        "the micro-batch.",
    )
    capacity: int = Field(
        64,
        ge=1,
        description="Items in flight between two stages on different ranks before the upstream "
        "stage waits (backpressure). Stages sharing ranks run one after the other: unbounded.",
    )
    balance: Literal["performance_aware", "shortest_queue", "round_robin"] = Field(
        "performance_aware",
        description="How a stage's items are spread over the ranks of the next one (stages on the "
        "same ranks keep them local): by measured speed, by queued weight, or evenly by count "
        "(what a trainer that splits each batch into equal shards does). Engines, fixed "
        "micro-batches (elastic = false) and stages whose finish trains on what each rank took "
        "always get an even split: no per-item speed describes their work.",
    )

    @model_validator(mode="after")
    def _check_sizes(self) -> PipelineConfig:
        if self.min_micro_batch > self.max_micro_batch:
            raise ValueError(
                f"min_micro_batch ({self.min_micro_batch}) is larger than max_micro_batch "
                f"({self.max_micro_batch}); lower the minimum or raise the maximum"
            )
        if not self.min_micro_batch <= self.micro_batch <= self.max_micro_batch:
            raise ValueError(
                f"micro_batch ({self.micro_batch}) must lie between min_micro_batch "
                f"({self.min_micro_batch}) and max_micro_batch ({self.max_micro_batch})"
            )
        return self
