"""`Pipeline`: the macro flow's stages, run as a micro flow of pipelined micro-batches.

The flow names its stages once (component + method) and calls `run(items)` per step; that is
the whole macro flow. Each step, the runtime links consecutive stages by channels, starts every
stage on every rank of its component (`Worker.run_stage`), feeds the items from the
coordinator and collects the last stage's outputs. What happens in between depends only on the
placement in the config, never on the flow::

    pipe = Pipeline(coordinator, "toy")
    pipe.stage("rollout", "generate").stage("reward", "score").stage("actor", "learn", finish="step")
    for step in range(10):
        result = pipe.run(prompts)          # same code for every placement

* Stages on disjoint ranks run at the same time; micro-batches stream through bounded channels
  (backpressure) balanced over the consumer ranks.
* Stages sharing ranks run one after the other on those ranks (a rank executes its commands in
  order: that is the device lock), each switched in by the rank's time-share; their stream is
  unbounded and local-first, so data stays on the rank that produced it.
* ``placement.mode = "auto"`` runs the first ``auto_warmup_steps`` steps collocated, builds a
  `PhaseProfile` per stage from what the ranks measured, asks the cost model, re-partitions if
  disaggregated wins, and logs the predicted step time next to the measured one.

`Pipeline.start` returns a `RunningStep` at once; `start_steps` starts steps of several
pipelines together (one-step off-policy GRPO trains on step t's samples while step t+1's are
generated).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlinf_hpc.errors import UserError
from rlinf_hpc.log import get_logger
from rlinf_hpc.scheduler.autoplace import AutoPlacement
from rlinf_hpc.scheduler.elastic import micro_batch_bound
from rlinf_hpc.scheduler.protocol import StageSpec
from rlinf_hpc.scheduler.steps import RunningStep, start_steps

if TYPE_CHECKING:
    from rlinf_hpc.scheduler.coordinator import Coordinator

log = get_logger("pipeline")

#: Capacity of a stream whose consumers wait for earlier stages on their own ranks.
UNBOUNDED = 1_000_000


@dataclass(frozen=True)
class Stage:
    component: str
    method: str
    finish: str | None = None
    weight_key: str | None = None
    continuous: bool = False
    finish_scales: bool = False


@dataclass
class StepResult:
    """What one `Pipeline.run` produced and measured."""

    step: int
    #: The last stage's outputs, rank by rank (order within a rank is arrival order).
    outputs: list[Any]
    #: Component -> the ``finish`` method's value on each of its ranks.
    finished: dict[str, list[Any]]
    seconds: float
    placement: str
    #: One summary per stage: items, micro-batch sizes, elastic changes, busy/wait/switch.
    stages: list[dict[str, Any]] = field(default_factory=list)
    #: Per stage and rank, what `run_stage` returned (without outputs).
    per_rank: list[list[dict[str, Any]]] = field(default_factory=list)
    #: The coordinator's CPU while the step ran, in cores (its share of a core).
    coordinator_busy: float = 0.0


class Pipeline:
    """Stages of a macro flow; `run` executes one step of them on the current placement."""

    def __init__(
        self,
        coordinator: Coordinator,
        name: str = "pipeline",
        work: Callable[[StepResult], float | None] | None = None,
    ) -> None:
        """``work``: a step's amount of work in the flow's own unit (an RL step's tokens), from
        its result. ``auto`` then compares steps on different placements per unit of work:
        the workload drifts as the policy learns (its responses grow or shrink), and its
        measured move compares later steps with earlier ones."""
        self.coordinator = coordinator
        self.name = name
        self.work = work
        self.stages: list[Stage] = []
        self._step = 0
        self._streams: list[str] = []
        placement = coordinator.config.placement
        if placement.mode == "auto" and placement.groups:
            raise UserError(
                f"pipeline '{name}': placement.mode = \"auto\" places a Pipeline's stages from a "
                "collocated warm-up (every stage on every worker rank), but placement.groups "
                f"{placement.groups} asks for a warm-up with shared groups, which only flows that "
                "place themselves use. Remove placement.groups, or choose hybrid with these groups."
            )
        self._auto = AutoPlacement(coordinator, name) if placement.mode == "auto" else None
        #: A step of this pipeline is on the ranks (started, its result not yet taken).
        self.running = False
        #: Component -> the largest micro-batch its device memory allows (`bound_micro_batches`).
        self.micro_batch_bounds: dict[str, int] = {}
        #: Component -> the size its elastic micro-batches start at in the next step, instead
        #: of the size its ranks carried (set by ``auto`` when it moves the ranks; used once).
        self.first_sizes: dict[str, int] = {}
        self._bounded = False

    def stage(
        self,
        component: str,
        method: str,
        finish: str | None = None,
        weight_key: str | None = None,
        continuous: bool = False,
        finish_scales: bool = False,
    ) -> Pipeline:
        """Append a stage: ``component``'s ``method(batch) -> outputs`` on every micro-batch;
        ``finish()`` once after its input ended (its value lands in `StepResult.finished`).
        ``continuous=True``: ``method(feed)`` once per step, a generator admitting items from
        the feed as it has room (a generation engine's continuous batching, whose long tail is
        then paid once per step instead of once per micro-batch); its input is split evenly by
        count over its ranks (round robin): every item of the step is known when it starts, an
        engine's step is set by the requests it is given, and no per-item rate describes an
        engine. Shortest queue, used before, gave one engine in ten ~25% more requests per step
        at 16 emulated ranks (its slots had freed just before the feed's last window, so its
        queue looked empty) and that engine ended every step ~20% after the others.
        ``finish_scales=True``: the finish's work grows with the items the rank took (an
        update over the step's samples, as the math actor trains) instead of being a fixed
        step (an optimizer step after micro-batched training); ``auto`` then predicts it per
        item: on fewer ranks, each rank's finish takes longer."""
        if component not in self.coordinator.placement.groups:
            raise KeyError(
                f"pipeline '{self.name}': no component '{component}'; the job has "
                f"{', '.join(self.coordinator.placement.groups)}"
            )
        if any(s.component == component for s in self.stages):
            raise ValueError(f"pipeline '{self.name}': component '{component}' is a stage already")
        self.stages.append(Stage(component, method, finish, weight_key, continuous, finish_scales))
        return self

    def place_together(self, *others: Pipeline) -> None:
        """Pipelines that run at the same time (one-step off-policy: this one generates, the
        others train) are placed as one by ``auto``: one warm-up, one decision for all their
        stages (`rank_split.predict_ahead`). Nothing to do with a placement of the config's."""
        if self._auto is None:
            return
        for other in others:
            other._auto = self._auto
        self._auto.place_together([self, *others])

    @property
    def placement_label(self) -> str:
        if self._auto is not None:
            return self._auto.label
        return self.coordinator.config.placement.mode

    def run(self, items: list[Any], weights: list[float] | None = None) -> StepResult:
        """One step: feed ``items`` to the first stage and wait for every stage to finish."""
        return self.start(items, weights).result()

    def start(self, items: list[Any], weights: list[float] | None = None) -> RunningStep:
        """Start one step and return at once (after feeding it): `RunningStep.result` waits.
        To run steps of several pipelines at the same time, use `start_steps`."""
        return start_steps((self, items, weights))[0]

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the step count and `auto`'s measurements and decision (the
        elastic micro-batch sizes live on the workers and are saved with them)."""
        return {
            "step": self._step,
            "auto": self._auto.state_dict() if self._auto else None,
            "micro_batch_bounds": dict(self.micro_batch_bounds),
            "first_sizes": dict(self.first_sizes),  # auto moved the ranks, no step ran since
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._step = state["step"]
        self.micro_batch_bounds = dict(state.get("micro_batch_bounds", {}))
        self.first_sizes = dict(state.get("first_sizes", {}))
        self._bounded = bool(self.micro_batch_bounds)
        if self._auto is not None and state["auto"] is not None:
            self._auto.load_state_dict(state["auto"])

    def close(self) -> None:
        """Remove the last step's streams (the job's end does it too)."""
        if self._streams:
            self.coordinator.update_channels({}, remove=self._streams)
            self._streams = []

    # -- one step ------------------------------------------------------------------------------
    def _stream_specs(self, names: list[str]) -> dict[str, dict[str, Any]]:
        placement = self.coordinator.placement
        config = self.coordinator.config.pipeline
        specs = {}
        earlier: set[int] = set()
        for index, stage in enumerate(self.stages):
            consumers = set(placement.ranks_of(stage.component))
            producer = "coordinator" if index == 0 else self.stages[index - 1].component
            waits_on_rank = bool(consumers & earlier)  # its ranks run an earlier stage first
            # An engine's step is set by the requests it gets: an even split (see `stage`).
            # So is a fixed micro-batch stage's: every micro-batch is ``micro_batch`` items (a
            # rank's last one excepted), so an even split by count is one in micro-batches.
            # Measured speed ran away there: a generate call costs about its longest response
            # whatever its count, so a rank given a short last micro-batch read as slow and the
            # others as fast, and those got more (24 emulated ranks, a 7B profile with a 10%
            # tail: one rollout rank took 4-5 micro-batches of 32 while 18 took 2, and the step
            # swung between 4.1 and 7.8 s). And a stage whose finish trains on what the rank
            # took (`finish_scales`): its work comes at the end, in proportion to its share,
            # and its per-micro-batch speed says nothing of it (an emulated trainer's ranks got
            # 90 to 424 of 1,024 samples, and the step waited on the one with 424).
            even = stage.continuous or stage.finish_scales or not config.elastic
            balance = "round_robin" if even else config.balance
            specs[names[index]] = {
                "producers": producer,
                "consumers": stage.component,
                "policy": "local_first" if waits_on_rank else balance,
                "capacity": UNBOUNDED if waits_on_rank else config.capacity,
                "lineage": f"{self.name}.{index}",  # rates learnt in one step serve the next
            }
            earlier |= consumers
        return specs

    def _prepare(self, items: list[Any]) -> tuple[list[str], dict[str, dict[str, Any]]]:
        """The next step's stream names and specs (declared by `start_steps`)."""
        if not self.stages:
            raise ValueError(f"pipeline '{self.name}' has no stages; add them with stage()")
        if not items:
            raise ValueError(f"pipeline '{self.name}': run() needs at least one item")
        self._step += 1
        names = [f"{self.name}.step{self._step}.{i}" for i in range(len(self.stages))]
        return names, self._stream_specs(names)

    def _launch(self, names: list[str], specs: dict[str, dict[str, Any]]) -> list[Any]:
        """Start every stage on every rank of its component; returns the futures."""
        coordinator = self.coordinator
        config = coordinator.config.pipeline
        futures = []
        for index, stage in enumerate(self.stages):
            largest = min(
                config.max_micro_batch, self.micro_batch_bounds.get(stage.component, config.max_micro_batch)
            )
            spec = StageSpec(
                stage.method,
                names[index],
                names[index + 1] if index + 1 < len(names) else None,
                stage.finish,
                min(config.micro_batch, largest),
                min(config.min_micro_batch, largest),
                largest,
                config.elastic,
                config.wait_threshold_s,
                config.memory_threshold,
                stage.weight_key,
                index + 1 < len(names) and specs[names[index + 1]]["policy"] != "local_first",
                stage.continuous,
                self.first_sizes.pop(stage.component, None),
            )
            futures.append(coordinator.group(stage.component).call("run_stage", spec.as_dict()))
        return futures

    def _result(self, futures: list[Any], start: float) -> StepResult:
        replies = [future.result() for future in futures]
        # the last reply's arrival, not this call's: another pipeline's step may have run longer
        seconds = max(f.resolved_at or start for group in futures for f in group.futures) - start
        outputs = [x for reply in replies[-1] for x in reply.pop("outputs")]
        for stage_replies in replies[:-1]:
            for reply in stage_replies:
                reply.pop("outputs")
        finished = {
            stage.component: [r["finish"] for r in stage_replies]
            for stage, stage_replies in zip(self.stages, replies, strict=True)
            if stage.finish
        }
        return StepResult(
            self._step,
            outputs,
            finished,
            seconds,
            self.placement_label,
            [_summarize(stage, rs) for stage, rs in zip(self.stages, replies, strict=True)],
            [[{k: v for k, v in r.items() if k != "finish"} for r in rs] for rs in replies],
        )

    def bound_micro_batches(self) -> None:
        """The largest micro-batch of each stage from its ranks' device memory, by the seed's
        rule (`elastic.micro_batch_bound`: 0.3 x (device - model state) / memory per sample,
        with the memory per sample the ranks measured, `Worker.memory_profile`), logged and
        recorded. Elastic sizing then never grows a micro-batch past it (its memory rule
        doubles the size under pressure); fixed micro-batches larger than it get a warning."""
        config = self.coordinator.config.pipeline
        calls = [self.coordinator.group(stage.component).call("memory_profile") for stage in self.stages]
        for stage, call in zip(self.stages, calls, strict=True):
            profiles = [p for p in call.result() if p]
            if not profiles:
                continue
            device = min(p["device_bytes"] for p in profiles)
            state = max(p["state_bytes"] for p in profiles)
            per_sample = max(p["bytes_per_sample"] for p in profiles)
            bound = micro_batch_bound(device, state, per_sample)
            log.info(
                "%s: largest micro-batch of %s = 0.3 x (%.1f GB device - %.1f GB state) / %.3f GB per "
                "sample = %d", self.name, stage.component, device / 1e9, state / 1e9, per_sample / 1e9, bound,
            )  # fmt: skip
            self.coordinator.record(
                "micro_batch_bound", pipeline=self.name, component=stage.component, bound=bound,
                device_bytes=device, state_bytes=state, bytes_per_sample=per_sample,
            )  # fmt: skip
            if config.elastic:
                self.micro_batch_bounds[stage.component] = bound
            elif config.micro_batch > bound:
                log.warning(
                    "%s: pipeline.micro_batch = %d is more than %s's device memory allows by the "
                    "rule above (%d); with pipeline.elastic = false it is kept: lower it if the "
                    "ranks run out of memory", self.name, config.micro_batch, stage.component, bound,
                )  # fmt: skip
        self._bounded = True

    def _after_step(self, result: StepResult, num_items: int) -> None:
        if not self._bounded:  # the ranks have measured their memory per sample now
            self.bound_micro_batches()
        if self._auto is not None:
            self._auto.after_step(self, result, num_items)
        for hook in self.coordinator.step_hooks:  # e.g. the memory-leak monitor
            hook(self.name, result)
        self.coordinator.record(
            "pipeline_step", pipeline=self.name, step=result.step, seconds=result.seconds,
            placement=result.placement, items=num_items, stages=result.stages,
            coordinator_busy=round(result.coordinator_busy, 4),
        )  # fmt: skip


_CPU_KEYS = ("cpu_s", "runqueue_s", "finish_cpu_s", "finish_runqueue_s")


def _summarize(stage: Stage, replies: list[dict[str, Any]]) -> dict[str, Any]:
    sizes = [size for r in replies for size in r["micro_batches"]]
    return {
        "component": stage.component,
        "method": stage.method,
        "items": sum(r["items"] for r in replies),
        "micro_batches": len(sizes),
        "micro_batch_sizes": sizes,
        "mean_micro_batch": sum(sizes) / len(sizes) if sizes else 0.0,
        "elastic_changes": [dict(c, rank=r["rank"]) for r in replies for c in r["changes"]],
        "busy_s": sum(r["busy_s"] for r in replies),
        "wait_s": sum(r["wait_s"] for r in replies),
        "finish_s": sum(r["finish_s"] for r in replies),
        # on a core and waiting for one, of the busy and finish times (`runtime.cpu_time`)
        **{key: sum(r.get(key, 0.0) for r in replies) for key in _CPU_KEYS},
        "switch_s": sum(r["switch_s"] for r in replies),
        "ranks": [r["rank"] for r in replies],
    }
