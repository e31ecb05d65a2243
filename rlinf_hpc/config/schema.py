"""Typed job configuration: one pydantic model per TOML section.

Every field has a description; ``rlinf-hpc config schema`` prints them all. Unknown keys are
rejected (``extra="forbid"``) and the loader turns that into a suggestion of the nearest key.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlinf_hpc.config.checkpoint import CheckpointConfig
from rlinf_hpc.config.scheduling import PipelineConfig, PlacementConfig
from rlinf_hpc.config.section import Section as _Section
from rlinf_hpc.config.watchdog import WatchdogConfig

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_COMPONENT_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")


class JobConfig(_Section):
    """[job]: the job as a whole."""

    name: str = Field("rlinf-job", description="Name shown in logs and used for the run directory.")
    seed: int = Field(0, ge=0, description="Base random seed; each rank derives its own from it.")
    num_ranks: int = Field(
        4,
        ge=1,
        description="Ranks to start when `rlinf-hpc run` launches the job itself (bundled mpiexec). "
        "Rank 0 is the coordinator; the rest are workers. `--np` overrides it; inside srun/sbatch "
        "the allocation decides.",
    )
    call_timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long the coordinator waits for a worker command before it reports who "
        "hangs and ends the job.",
    )
    shutdown_timeout_s: float = Field(
        10.0, gt=0, description="How long the coordinator waits for workers to acknowledge shutdown."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level on every rank."
    )


class ComponentConfig(_Section):
    """[components.NAME]: one component group (rollout, actor, reward, ...)."""

    worker: str = Field(
        description="Worker class as an import path `package.module:ClassName`; a subclass of "
        "rlinf_hpc.workers.Worker, instantiated once on each rank of the group."
    )
    num_ranks: int = Field(1, ge=1, description="Number of worker ranks in the group.")
    ranks: list[int] | None = Field(
        None,
        description="Explicit world ranks for the group (>= 1; rank 0 is the coordinator). "
        "Default: the next free worker ranks in config order. Components may list the same ranks "
        "only when [placement] mode is collocated or hybrid.",
    )
    device: Literal["cpu", "gpu", "any"] = Field(
        "any",
        description="`gpu`: every rank of the group needs a visible GPU; `cpu`: run on CPU even "
        "where a GPU is visible; `any`: the rank's own device.",
    )
    het_group: int | None = Field(
        None,
        ge=0,
        description="In a heterogeneous SLURM job (`#SBATCH hetjob`, slurm/hetjob_embodied.sbatch): "
        "run on the ranks of this component of the allocation (0: the first, which holds rank 0; "
        "e.g. CPU-only simulator nodes in 0, GPU nodes in 1). Default: any rank.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Free-form keyword arguments passed to the worker's `setup(**options)`.",
    )

    @field_validator("worker")
    @classmethod
    def _check_import_path(cls, value: str) -> str:
        if not _IMPORT_PATH.match(value):
            raise ValueError(f"'{value}' is not an import path of the form 'package.module:ClassName'")
        return value

    @model_validator(mode="after")
    def _check_ranks(self) -> ComponentConfig:
        if self.ranks is None:
            return self
        if any(r < 1 for r in self.ranks):
            raise ValueError("ranks must be >= 1 (world rank 0 is the coordinator)")
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"ranks lists a rank twice: {self.ranks}")
        if "num_ranks" in self.model_fields_set and self.num_ranks != len(self.ranks):
            raise ValueError(
                f"num_ranks = {self.num_ranks} but ranks lists {len(self.ranks)}; give one of them"
            )
        object.__setattr__(self, "num_ranks", len(self.ranks))
        return self


class ChannelConfig(_Section):
    """[channels.NAME]: a data channel from producer components to consumer components."""

    producers: list[str] = Field(
        description='Components whose ranks put items (or "coordinator" for rank 0).'
    )
    consumers: list[str] = Field(description="Components whose ranks get items.")
    policy: str = Field(
        "performance_aware",
        description="Load balancing across consumers: weighted_round_robin, shortest_queue, "
        "performance_aware, or an import path `package.module:Class` of a "
        "rlinf_hpc.channel.LoadBalancePolicy subclass.",
    )
    capacity: int = Field(
        64,
        ge=1,
        le=1_000_000,
        description="Items a producer may have sent and not yet seen consumed before `put` waits "
        "(or raises ChannelFull with block=False).",
    )
    consumer_weights: list[float] | None = Field(
        None,
        description="Shares for weighted_round_robin, one per consumer rank in placement order "
        "(default: equal).",
    )

    offload_above: float | None = Field(
        None,
        gt=0,
        le=1,
        description="On GPU consumers: when device memory in use passes this fraction of the "
        "device, queued items move to host memory (`prefetch` brings them back). Default: never.",
    )
    lineage: str | None = Field(
        None,
        description="Channels of one lineage share what their producers learn of each consumer's "
        "speed: a new channel starts from the rates the last one measured instead of assuming "
        "every consumer as fast as the fastest (pipelines name each stage's per-step streams so).",
    )

    @field_validator("producers", "consumers", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("consumer_weights")
    @classmethod
    def _positive_weights(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and (not value or any(w <= 0 for w in value)):
            raise ValueError("consumer_weights must be a non-empty list of numbers > 0")
        return value


class CommSectionConfig(_Section):
    """[comm]: the data plane between ranks."""

    verify: bool = Field(
        False,
        description="Integrity mode: every message carries a CRC32 of its header and payload, "
        "checked on receipt; a mismatch ends the job naming sender, tag and size. Costs one "
        "pass over the bytes on each side (a debugging aid for suspected corruption).",
    )


class FlowConfig(_Section):
    """[flow]: the macro flow run by the coordinator."""

    runner: str = Field(
        "hello",
        description="The app: a registered name (`hello`, `toy_pipeline`, `math_grpo`, "
        "`embodied_ppo`, or one an installed package registers), an import path `package.module:APP` of an "
        "rlinf_hpc.config.apps.App (its config sections join these), or an import path "
        "`package.module:function` of a bare flow taking a rlinf_hpc.scheduler.Coordinator.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Free-form parameters of the flow (`coordinator.config.flow.options`).",
    )


class Config(_Section):
    """A whole job configuration (one TOML file)."""

    job: JobConfig = Field(default_factory=JobConfig, description="The job as a whole.")
    components: dict[str, ComponentConfig] = Field(
        description="Component groups by name; each becomes a group of worker ranks."
    )
    channels: dict[str, ChannelConfig] = Field(
        default_factory=dict, description="Data channels between components, by name."
    )
    placement: PlacementConfig = Field(
        default_factory=PlacementConfig, description="How components share worker ranks."
    )
    flow: FlowConfig = Field(default_factory=FlowConfig, description="The macro flow.")
    pipeline: PipelineConfig = Field(
        default_factory=PipelineConfig, description="Micro-batching of pipelined stages."
    )
    comm: CommSectionConfig = Field(default_factory=CommSectionConfig, description="The data plane.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpoint-restart of long jobs."
    )
    watchdog: WatchdogConfig = Field(
        default_factory=WatchdogConfig, description="Heartbeats: stopped and dead ranks named."
    )

    @field_validator("components")
    @classmethod
    def _check_components(cls, value: dict[str, ComponentConfig]) -> dict[str, ComponentConfig]:
        if not value:
            raise ValueError("at least one component is needed, e.g. [components.rollout]")
        for name in value:
            if not _COMPONENT_NAME.match(name):
                raise ValueError(
                    f"component name '{name}' must start with a letter and hold only letters, "
                    "digits, '_' or '-'"
                )
        return value

    @model_validator(mode="after")
    def _check_channel_members(self) -> Config:
        known = set(self.components) | {"coordinator"}
        for name, channel in self.channels.items():
            for role in ("producers", "consumers"):
                members = getattr(channel, role)
                unknown = [m for m in members if m not in known]
                if unknown or not members:
                    raise ValueError(
                        f"channels.{name}.{role} names {unknown or 'nothing'}; use component names "
                        f'({", ".join(self.components)}) or "coordinator"'
                    )
            if "coordinator" in channel.consumers:
                raise ValueError(f"channels.{name}.consumers: the coordinator cannot consume")
        return self

    @model_validator(mode="after")
    def _check_placement(self) -> Config:
        mode, groups = self.placement.mode, self.placement.groups
        if groups and mode not in ("hybrid", "auto"):
            raise ValueError(
                f'placement.groups is only used with placement.mode = "hybrid" or "auto", not "{mode}"'
            )
        seen: set[str] = set()
        for group in groups:
            for name in group:
                if name not in self.components:
                    raise ValueError(
                        f"placement.groups names unknown component '{name}'; components: "
                        f"{', '.join(self.components)}"
                    )
                if name in seen:
                    raise ValueError(f"placement.groups lists component '{name}' twice")
                seen.add(name)
        if mode == "auto":
            pinned = [name for name, c in self.components.items() if c.ranks is not None]
            if pinned:
                raise ValueError(
                    f'placement.mode = "auto" decides the ranks itself, but components {pinned} '
                    "list explicit ranks; remove `ranks` or pick a manual mode"
                )
        if mode == "disaggregated":
            owner: dict[int, str] = {}
            for name, component in self.components.items():
                for rank in component.ranks or []:
                    if rank in owner:
                        raise ValueError(
                            f"components '{owner[rank]}' and '{name}' both list rank {rank}, but "
                            'placement.mode = "disaggregated" gives each component ranks of its '
                            'own; use "collocated" or "hybrid" to share ranks'
                        )
                    owner[rank] = name
        return self

    def placement_units(self) -> list[list[str]]:
        """Components that share ranks, one list per set of ranks (see [placement])."""
        mode = self.placement.mode
        if mode == "collocated" or (mode == "auto" and not self.placement.groups):
            return [list(self.components)]
        if mode in ("hybrid", "auto"):
            grouped = {name for group in self.placement.groups for name in group}
            return [list(g) for g in self.placement.groups] + [
                [name] for name in self.components if name not in grouped
            ]
        return [[name] for name in self.components]

    def unit_size(self, unit: list[str]) -> int:
        """Worker ranks of one placement unit: the most any member asks for — but in `auto`'s
        warm-up a group's members share what they would have apart (their sum), so that the
        flow can split those ranks between them later."""
        sizes = [self.components[n].num_ranks for n in unit]
        shared_warmup = self.placement.mode == "auto" and bool(self.placement.groups) and len(unit) > 1
        return sum(sizes) if shared_warmup else max(sizes)

    @property
    def num_worker_ranks_needed(self) -> int:
        """Smallest number of worker ranks (world size - 1) that can hold every component."""
        explicit = {r for c in self.components.values() if c.ranks for r in c.ranks}
        implicit = sum(
            self.unit_size(unit)
            for unit in self.placement_units()
            if all(self.components[n].ranks is None for n in unit)
        )
        # Implicit units take free ranks; explicit ones fix the highest rank used.
        return max(len(explicit) + implicit, max(explicit, default=0))
