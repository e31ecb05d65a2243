"""What a pipeline step measured, as the cost model's inputs: one `PhaseProfile` per stage
(`profiles_from_step`), each stage's mean micro-batch, and a profile's fields for the job's
records. ``placement.mode = "auto"`` (`autoplace`) decides from these, and the emulated
workload's benchmark prints them against what it measured.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from rlinf_hpc.scheduler.cost_model import PhaseProfile
from rlinf_hpc.scheduler.engine_model import EngineModel, fit_engine

if TYPE_CHECKING:
    from rlinf_hpc.scheduler.pipeline import Pipeline, StepResult


def profiles_from_step(pipeline: Pipeline, result: StepResult) -> list[PhaseProfile]:
    """One profile per stage from what its ranks measured in ``result``. Seconds per item are
    the slowest rank's busy time over an even share (the stage is done when its last rank is:
    uneven shares and uneven speeds both count); the finish (an optimizer step) and, for a
    continuous stage, the time to its first output are the ranks' means — a finish that scales
    with the rank's items (`Stage.finish_scales`: an update over the step's samples) is the
    slowest rank's over an even share, per item, like the busy time; a micro-batched
    stage's drain is its slowest rank's last micro-batch (and its size). The first stage's
    ranks start when the coordinator's feed gives them their first micro-batch: the earliest of
    them is the step's start (``start_seconds``), and each rank's later start counts in its time
    (the stage is done when its last rank is)."""
    profiles: list[PhaseProfile] = []
    upstream: list[dict[str, Any]] = []
    for stage, replies in zip(pipeline.stages, result.per_rank, strict=True):
        items = sum(r["items"] for r in replies)
        # the first stage's ranks: how long the feed kept each waiting (later stages': 0 here,
        # their first wait is their upstream's latency, which the cost model has)
        waits = [r.get("first_wait_s", 0.0) if not profiles else 0.0 for r in replies]
        start = min(waits)
        # each rank's time alone: without its wait for a core (CPU ranks sharing cores)
        alone = [r["busy_s"] - r.get("runqueue_s", 0.0) for r in replies]
        own = sum(alone) / max(1e-12, sum(r["busy_s"] for r in replies))  # of what was measured
        slowest = max(busy + wait - start for busy, wait in zip(alone, waits, strict=True))
        switch = sum(r["switch_s"] for r in replies) / max(1, len(replies))
        finishes = [r.get("finish_s", 0.0) - r.get("finish_runqueue_s", 0.0) for r in replies]
        finish = sum(finishes) / max(1, len(replies))
        firsts = [r["first_output_s"] * own for r in replies if r.get("first_output_s") is not None]
        first = sum(firsts) / len(firsts) if firsts else None
        latency = first if stage.continuous else None
        # a micro-batched stage whose method streams: its first output before its micro-batch ends
        streamed = 0.0 if stage.continuous or first is None else first
        per_item = slowest * len(replies) / max(1, items)
        engine = _engine_model(replies, alone) if stage.continuous else None
        drain, drain_items = 0.0, 0
        if not stage.continuous:  # the slowest rank's last micro-batch, and its items
            drain, drain_items = max((r.get("last_s", 0.0), r.get("last_items", 0)) for r in replies)
            drain = max(drain, _backlog(upstream, replies)) * own
        finish_per_item = 0.0
        if stage.finish_scales:
            finish_per_item = max(finishes) * len(replies) / max(1, items)
            finish = 0.0
        profile = PhaseProfile(stage.component, per_item, 0.0, switch, finish, latency, engine, start)
        profiles.append(
            replace(
                profile, drain_seconds=drain, drain_items=drain_items, finish_per_item=finish_per_item,
                first_output_seconds=streamed, cpu_fraction=_share(replies, "cpu_s", alone),
                finish_cpu_fraction=_share(replies, "finish_cpu_s", finishes),
            )
        )  # fmt: skip
        upstream = replies
    return profiles


def _backlog(upstream: list[dict[str, Any]], replies: list[dict[str, Any]]) -> float:
    """How long after its upstream's last output a stage on ranks of its own ended (its slowest
    rank; 0 for the first stage, or one sharing ranks with its upstream). A long-tailed
    stream's last items are its heaviest and come last: with a static batch that streams its
    responses as they finish, most of a per-token stage's work came in the last seconds of
    the generation, queued, and the stage ended several micro-batches after its last input
    (rev-tight at 24 ranks: the trainer 2.1 s after, its last micro-batch 1.1 s)."""
    below, here = {r.get("rank") for r in upstream}, {r.get("rank") for r in replies}
    if not upstream or None in below | here or below & here:
        return 0.0
    outputs = [r["last_output_at"] for r in upstream if r.get("last_output_at") is not None]
    ends = [r["ended_at"] for r in replies if r.get("ended_at") is not None and r.get("items")]
    if not outputs or not ends:
        return 0.0
    return max(0.0, max(ends) - max(outputs))


def _share(replies: list[dict[str, Any]], key: str, alone: list[float]) -> float:
    """What share of the ranks' time alone (busy or finish) was on a core (`runtime.cpu_time`;
    0 where not measured)."""
    return min(1.0, sum(r.get(key, 0.0) for r in replies) / max(1e-12, sum(alone)))


def _engine_model(replies: list[dict[str, Any]], alone: list[float]) -> EngineModel | None:
    """The engine model of a continuous stage whose every rank reported its steps, pooled,
    calibrated to the ranks' busy times alone."""
    reports = [r.get("engine") for r in replies]
    if not reports or any(not report for report in reports):
        return None
    steps = [tuple(step) for report in reports for step in report["steps"]]
    lengths = [n for report in reports for n in report["lengths"]]
    fitted = fit_engine(steps, lengths, min(int(report["slots"]) for report in reports))
    if fitted is None:
        return None
    fitted = replace(fitted, stop_fraction=max(float(r.get("partial") or 0.0) for r in reports))
    shares = [list(report["lengths"]) for report in reports]
    return fitted.calibrated(alone, [r["items"] for r in replies], shares)


def stage_micro_batches(pipeline: Pipeline, result: StepResult) -> list[int]:
    """Each stage's mean micro-batch in the step (a continuous stage, which has none, and a
    stage that got nothing: the configured size)."""
    configured = pipeline.coordinator.config.pipeline.micro_batch
    sizes = []
    for stage, summary in zip(pipeline.stages, result.stages, strict=True):
        own = [] if stage.continuous else summary["micro_batch_sizes"]
        sizes.append(max(1, round(sum(own) / len(own))) if own else configured)
    return sizes


def profile_fields(profile: PhaseProfile) -> dict[str, Any]:
    return {
        "name": profile.name,
        "seconds_per_item": profile.seconds_per_item,
        "switch_seconds": profile.switch_seconds,
        "finish_seconds": profile.finish_seconds,
        "finish_per_item": profile.finish_per_item,
        "cpu_fraction": profile.cpu_fraction,
        "finish_cpu_fraction": profile.finish_cpu_fraction,
        "latency_seconds": profile.latency_seconds,
        "engine": None
        if profile.engine is None
        else {
            "step_s": profile.engine.step_s,
            "seq_step_s": profile.engine.seq_step_s,
            "slots": profile.engine.slots,
            "requests": len(profile.engine.lengths),
        },
    }
