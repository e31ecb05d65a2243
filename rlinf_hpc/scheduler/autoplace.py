"""``placement.mode = "auto"``: measure a short collocated warm-up, ask the cost model, move.

The job starts with every component on every worker rank. After ``auto_warmup_steps`` pipeline
steps, each stage's measured seconds per item (its slowest rank's busy time over an even share,
without the time it waited for a core: `contention`), switch time, finish time and (an
engine's) time to first output become a `PhaseProfile`;
`rank_split.predict` compares collocated against a disaggregated split of the worker ranks in
proportion to the stages' work (an engine that reports its steps is modelled instead:
`engine_model.EngineModel`, its time on another share of the requests). If disaggregated wins,
the coordinator re-partitions (ranks leave the components they no longer host, their state is
torn down). The choice is logged and recorded with both predictions, and after the next step
with the measured step time next to the predicted one. The move is then measured
(``auto_verify_steps`` steps): a split not faster than the collocated warm-up goes back, the
joining ranks taking the state of a rank that kept it (`Worker.keep_state`/`adopt_state`).
(Every pipeline, auto's too, bounds each
stage's largest micro-batch by its device memory after its first step:
`Pipeline.bound_micro_batches`.)

One-step off-policy RL runs two pipelines at once (`off_policy.OneStepAhead`): they share one
`AutoPlacement` (`Pipeline.place_together`), whose warm-up runs both collocated, and
`rank_split.predict_ahead` splits the ranks between generation and training so that the longer
of the two is shortest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlinf_hpc.log import get_logger
from rlinf_hpc.scheduler.contention import shared_cores
from rlinf_hpc.scheduler.profiles import profile_fields, profiles_from_step
from rlinf_hpc.scheduler.rank_split import Prediction, predict, predict_ahead

if TYPE_CHECKING:
    from rlinf_hpc.scheduler.coordinator import Coordinator
    from rlinf_hpc.scheduler.pipeline import Pipeline, StepResult

log = get_logger("auto")


class AutoPlacement:
    """The auto mode's state for a pipeline, or for pipelines placed together: warming up,
    then decided."""

    def __init__(self, coordinator: Coordinator, owner: str) -> None:
        self.coordinator = coordinator
        self.warmup_steps = coordinator.config.placement.auto_warmup_steps
        #: Steps measured on the split before it is kept (after the first there, which pays
        #: the move: micro-batch sizes on probation, rebuilt data parallelism, cold caches); if
        #: their mean is not faster than the collocated warm-up, the prediction was wrong and
        #: the ranks go back (`_verify`).
        self.verify_steps = coordinator.config.placement.auto_verify_steps
        #: The pipelines placed together (`place_together`; none: the one named ``owner``)
        self.pipelines: list[Pipeline] = []
        self.names = [owner]
        self.counts: dict[str, int] = {}  # steps each pipeline reported
        self._latest: dict[str, tuple[StepResult, int]] = {}  # its last step and its items
        self.decided_at: int | None = None  # `steps` when the choice was made
        self.choice: str | None = None
        self.prediction: Prediction | None = None
        self.measured_s: float | None = None
        #: The collocated warm-up's step and groups (a move back takes them again).
        self.warmup_s: float | None = None
        self.before: dict[str, list[int]] | None = None
        self.split_steps: list[float] = []  # the split's steps after its first
        #: The same steps' work in the flow's own unit (`Pipeline.work`; None: not reported).
        #: RL workloads drift (responses grow or shrink as the policy learns), so the split's
        #: steps and the warm-up's are compared per unit of work.
        self.warmup_work: float | None = None
        self.split_work: list[float | None] = []
        self.verified = False  # the split measured faster, or the ranks went back
        self.reverted = False

    @property
    def steps(self) -> int:
        """Steps every pipeline placed together has run (the fewest)."""
        return min(self.counts.get(name, 0) for name in self.names)

    def place_together(self, pipelines: list[Pipeline]) -> None:
        """Measure and place these pipelines as one (they run at the same time: generation and
        training of one-step off-policy RL, in that order)."""
        self.pipelines = list(pipelines)
        self.names = [p.name for p in pipelines]

    @property
    def label(self) -> str:
        return f"auto:{self.choice}" if self.choice else "auto:warm-up (collocated)"

    @property
    def predicted_s(self) -> float | None:
        if self.prediction is None:
            return None
        return getattr(self.prediction, self.choice or "collocated")

    def state_dict(self) -> dict[str, Any]:
        """Warm-up progress, the prediction and the decision (a resumed run does not re-measure)."""
        prediction = None
        if self.prediction is not None:
            prediction = {
                "collocated": self.prediction.collocated,
                "disaggregated": self.prediction.disaggregated,
                "ranks_per_phase": dict(self.prediction.ranks_per_phase),
            }
        return {
            "steps": self.steps,
            "counts": dict(self.counts),
            "decided_at": self.decided_at,
            "choice": self.choice,
            "prediction": prediction,
            "measured_s": self.measured_s,
            "warmup_s": self.warmup_s,
            "before": self.before,
            "split_steps": list(self.split_steps),
            "warmup_work": self.warmup_work,
            "split_work": list(self.split_work),
            "verified": self.verified,
            "reverted": self.reverted,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.choice, self.measured_s = state["choice"], state["measured_s"]
        # checkpoints from before pipelines could be placed together hold one count
        self.counts = dict(state.get("counts") or dict.fromkeys(self.names, state["steps"]))
        self.decided_at = state.get("decided_at", self.warmup_steps if self.choice else None)
        self.prediction = Prediction(**state["prediction"]) if state["prediction"] else None
        self.warmup_s, self.before = state.get("warmup_s"), state.get("before")
        self.split_steps = list(state.get("split_steps", []))
        self.warmup_work = state.get("warmup_work")
        self.split_work = list(state.get("split_work", [None] * len(self.split_steps)))
        # checkpoints from before ``auto`` verified its move: a split is kept as it was
        self.verified = state.get("verified", self.choice is not None)
        self.reverted = state.get("reverted", False)

    def after_step(self, pipeline: Pipeline, result: StepResult, num_items: int) -> None:
        self.counts[pipeline.name] = self.counts.get(pipeline.name, 0) + 1
        self._latest[pipeline.name] = (result, num_items)
        members = self.pipelines or [pipeline]
        if any(p.running for p in members):
            return  # the others' steps are still on the ranks: nothing can move now
        if self.choice is None:
            if self.steps >= self.warmup_steps:
                self._decide(members)
            return
        if self.measured_s is None and self.decided_at is not None and self.steps > self.decided_at:
            self.measured_s = max(self._latest[p.name][0].seconds for p in members)
            predicted = self.predicted_s or 0.0
            error = 100 * (self.measured_s - predicted) / max(predicted, 1e-9)
            log.info(
                "auto: %s step predicted %.3f s, measured %.3f s (%+.0f%%)",
                self.choice, predicted, self.measured_s, error,
            )  # fmt: skip
            self.coordinator.record(
                "auto_placement_measured",
                choice=self.choice,
                predicted_s=predicted,
                measured_s=self.measured_s,
            )
            return
        if self.choice == "disaggregated" and not self.verified and self.decided_at is not None:
            self.split_steps.append(max(self._latest[p.name][0].seconds for p in members))
            self.split_work.append(self._work(members))
            if len(self.split_steps) >= self.verify_steps:
                self._verify(members)

    def _decide(self, members: list[Pipeline]) -> None:
        measured = [(p, *self._latest[p.name]) for p in members]
        profiles = [profiles_from_step(p, result) for p, result, _ in measured]
        ranks = list(self.coordinator.worker_ranks)
        config = self.coordinator.config.pipeline
        # elastic: while a stage waits on the one before (the pipeline's fill and drain, which
        # is when one micro-batch's time counts), that one shrinks its micro-batches to the least
        micro_batch = config.min_micro_batch if config.elastic else config.micro_batch
        step_s = max(result.seconds for _, result, _ in measured)  # the pipelines start together
        cores = shared_cores(self.coordinator, max(result.coordinator_busy for _, result, _ in measured))
        if len(measured) == 1:
            items = measured[0][2]
            prediction = predict(profiles[0], items, micro_batch, len(ranks), step_s, cores)
        elif len(measured) == 2:
            both = (measured[0][2], measured[1][2])
            prediction = predict_ahead(*profiles, both, micro_batch, len(ranks), step_s, cores)
        else:
            raise ValueError(f"auto places one pipeline or two side by side, not {len(measured)}")
        self.prediction, self.choice, self.decided_at = prediction, prediction.choice, self.steps
        self.warmup_s, self.warmup_work = step_s, self._work(members)
        self.verified = prediction.choice == "collocated" or self.verify_steps == 0
        self.before = {name: list(ranks) for name, ranks in self.coordinator.placement.groups.items()}
        together = f" ({' and '.join(p.name for p in members)}, placed together)" if len(members) > 1 else ""
        log.info(
            "auto: warm-up step %.3f s%s; predicted collocated %.3f s, disaggregated %.3f s %s -> %s",
            step_s, together, prediction.collocated, prediction.disaggregated,
            prediction.ranks_per_phase or "", prediction.choice,
        )  # fmt: skip
        self.coordinator.record(
            "auto_placement",
            pipelines=[p.name for p in members],
            choice=prediction.choice,
            warmup_step_s=step_s,
            predicted_collocated_s=prediction.collocated,
            predicted_disaggregated_s=prediction.disaggregated,
            ranks_per_phase=prediction.ranks_per_phase,
            profiles=[profile_fields(p) for group in profiles for p in group],
        )
        if prediction.choice == "disaggregated":
            for pipeline in members:
                pipeline.close()  # finished streams must not follow the ranks around
                if config.elastic:  # start where the prediction did, not at the warm-up's sizes
                    pipeline.first_sizes = {
                        s.component: micro_batch for s in pipeline.stages if not s.continuous
                    }
            groups, start = {}, 0
            for profile in (p for group in profiles for p in group):
                count = prediction.ranks_per_phase[profile.name]
                groups[profile.name] = ranks[start : start + count]
                start += count
            self.coordinator.repartition(groups)

    def _work(self, members: list[Pipeline]) -> float | None:
        """The last step's work of the pipelines placed together (their `Pipeline.work`
        summed), or None when one of them does not report it."""
        works = [p.work(self._latest[p.name][0]) if p.work else None for p in members]
        return None if any(w is None or w <= 0 for w in works) else float(sum(works))  # type: ignore[misc]

    def _verify(self, members: list[Pipeline]) -> None:
        """Keep the split if its steps measured faster than the collocated warm-up; else move
        every component back to the ranks it had then. Ranks that join a component take the
        state of one that kept it (`Worker.keep_state` / `adopt_state`: the actor's weights and
        optimizer moments, inference's reference policy); what a flow re-derives each step
        (a rollout's weights, synced from the actor) it re-derives."""
        split = sum(self.split_steps) / len(self.split_steps)
        warmup = self.warmup_s or 0.0
        self.verified = True
        faster, per_work = split < warmup, ""
        if self.warmup_work and warmup > 0 and all(self.split_work):
            split_rate = sum(self.split_steps) / sum(self.split_work)  # type: ignore[arg-type]
            warmup_rate = warmup / self.warmup_work
            faster = split_rate < warmup_rate
            per_work = (
                f"; per unit of work (the steps did {sum(self.split_work) / len(self.split_work):.4g}"  # type: ignore[arg-type]
                f" and {self.warmup_work:.4g}) {split_rate / warmup_rate:.2f}x the warm-up's time"
            )
        if faster or self.before is None:
            log.info(
                "auto: the split measured %.3f s per step (%d steps), collocated %.3f s%s: kept",
                split, len(self.split_steps), warmup, per_work,
            )  # fmt: skip
            self.coordinator.record("auto_placement_verified", split_s=split, collocated_s=warmup, kept=True)
            return
        coordinator = self.coordinator
        now = coordinator.placement.groups
        sources, too_large = {}, []
        for name, ranks in self.before.items():
            if set(ranks) - set(now[name]):  # ranks join it: they take the state of its first
                kept = coordinator.group(name).subset([0]).call("keep_state").result()[0]
                if kept["state"]:
                    sources[name] = now[name][0]
                if kept["state"] and not kept["kept"]:
                    too_large.append(f"{name} ({kept['bytes'] / 2**30:.1f} GiB)")
        if too_large:
            log.warning(
                "auto: the split measured %.3f s per step, not faster than the collocated warm-up's "
                "%.3f s, but moving back would copy the state of %s through host memory to the "
                "joining ranks: kept the split (placement.auto_verify_steps = 0 skips this check)",
                split, warmup, ", ".join(too_large),
            )  # fmt: skip
            for name in sources:  # the copies the others kept: dropped
                coordinator.group(name).subset([0]).call("keep_state", -1).result()
            coordinator.record(
                "auto_placement_verified", split_s=split, collocated_s=warmup, kept=True, too_large=too_large
            )
            return
        for pipeline in members:
            pipeline.close()
            pipeline.first_sizes = {}
        coordinator.repartition(self.before)
        for name, source in sources.items():
            coordinator.group(name).call("adopt_state", source).result()
        self.choice, self.reverted = "collocated", True
        log.warning(
            "auto: the split measured %.3f s per step (%d steps; predicted %.3f s), not faster than "
            "the collocated warm-up's %.3f s%s: moved back to collocated",
            split, len(self.split_steps), self.prediction.disaggregated if self.prediction else 0.0, warmup,
            per_work,
        )  # fmt: skip
        coordinator.record("auto_placement_verified", split_s=split, collocated_s=warmup, kept=False)
