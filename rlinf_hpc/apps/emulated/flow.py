"""The `emulated_rl` flow: the math job's macro flow (stages in profile order, a weight sync
after each step) over `EmulatedStage` workers, measuring what the scale benchmark reports.

Per step (``metrics.jsonl``): step time (the pipelines' clock, from the step's stream
declarations, and the weight sync; ``wall_s``: the time since the previous step's record, the
flow's bookkeeping included), the
weight sync, each stage's busy time and mean micro-batch, the **idle fraction** of the worker
ranks (1 - work at full efficiency / (ranks x step time): long-tail waiting, pipeline bubbles,
switches and syncs all count as idle), the **coordinator's own CPU time** in the step (rank 0's
process time: the runtime's overhead at this scale), and after the first step the **cost
model's prediction** of this placement's step time (`scheduler.cost_model.placement_time` from
the previous step's measurements, the same profiles ``auto`` builds: per-item seconds of each
stage's slowest rank, switches, finishes, an engine's time to first output, each stage's mean
micro-batch) next to the measured one. The response lengths are a function of (job seed, step),
the same in every mode. With ``emulation.off_policy_steps = 1`` the training stages (the profile's
``train_stages``: the actor, and a critic after it if the profile has one) are a pipeline of
their own, fed step t's samples while the others produce step t+1's (as `apps.math.flow` does
for GRPO). With ``emulation.partial_rollouts`` the rollout engines carry their last responses
into the next step (`EmulatedStage.engine`); a step then trains on about as many samples as it
generates, some of them begun the step before (``partial_carried``; ``policy_lag`` counts
them); what the engines still hold after the last step is not trained (the job ends; this app
saves no checkpoints).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from rlinf_hpc.apps.emulated.profile_file import get_profile
from rlinf_hpc.apps.emulated.profiles import Profile
from rlinf_hpc.log import get_logger
from rlinf_hpc.runtime.console import print_table
from rlinf_hpc.runtime.metrics import MetricsLog
from rlinf_hpc.scheduler import Coordinator, Pipeline, StepResult
from rlinf_hpc.scheduler.cost_model import placement_time
from rlinf_hpc.scheduler.off_policy import OneStepAhead
from rlinf_hpc.scheduler.profiles import profiles_from_step, stage_micro_batches

log = get_logger("emulated")


def sync_weights(coordinator: Coordinator, profile: Profile, sync: int) -> float:
    """The policy trainer's (the first of the profile's ``train_stages``) rank 0 -> every rank of
    the profile's ``sync_to`` stages, bandwidth-scaled; a rank that holds sync ``sync``'s weights
    already (the sender's, or another of its components received them) copies them locally."""
    started = time.monotonic()
    push = coordinator.group(profile.train_stages[0]).subset([0]).call("send_weights", sync)
    pulls = [coordinator.group(name).call("receive_weights", sync) for name in profile.sync_to]
    push.result()
    for pull in pulls:
        pull.result()
    return time.monotonic() - started


def predict(pipe: Pipeline, result: Any, num_items: int) -> float:
    """This placement's step time by the cost model, from what ``result``'s step measured."""
    ranks = [{r["rank"] for r in replies} for replies in result.per_rank]
    profiles = profiles_from_step(pipe, result)
    return placement_time(profiles, num_items, stage_micro_batches(pipe, result), ranks)


def _tokens_taken(stage: str) -> Callable[[StepResult], float]:
    """A step's work (`auto` compares steps per unit of it): the tokens ``stage`` took."""
    return lambda result: float(sum(stats["tokens"] for stats in result.finished[stage]))


def emulated_rl_flow(coordinator: Coordinator) -> dict[str, Any]:
    config = coordinator.config
    emulation = config.emulation
    profile = get_profile(emulation.profile)
    samples = emulation.samples_per_step or profile.samples_per_step
    workers = len(coordinator.worker_ranks)
    log.info(
        "EMULATION (sleep-costed stages, not a measurement of real devices): %s, %d samples per "
        "step, time scale %g, %d worker ranks", profile.description, samples, emulation.time_scale, workers,
    )  # fmt: skip
    off_policy = bool(emulation.off_policy_steps)
    parts = (
        [("emulated_gen", list(profile.generation_stages)), ("emulated_train", list(profile.train_stages))]
        if off_policy
        else [("emulated", list(profile.stages))]
    )
    pipes = []
    for name, components in parts:
        pipes.append(Pipeline(coordinator, name, work=_tokens_taken(components[-1])))
        for component in components:
            engine = emulation.continuous_generation and profile.stages[component].kind == "generate"
            pipes[-1].stage(
                component, "engine" if engine else "process", finish="finish", weight_key="length",
                continuous=engine, finish_scales=profile.stages[component].finish_per_sample > 0,
            )  # fmt: skip
    metrics = MetricsLog(coordinator.run_dir, False)
    history: list[dict[str, Any]] = []
    predicted: float | None = None
    predicted_for = ""  # the placement the prediction is for (auto changes it after warm-up)

    def items_of(step: int) -> tuple[list[dict[str, Any]], list[float]]:
        """The step's prompts. Their weight is 1: how long a response will be is not known
        before it is generated (later stages weigh responses by their length)."""
        lengths = profile.lengths(random.Random(f"{config.job.seed}:{step}"), samples)
        return [{"uid": i, "length": length} for i, length in enumerate(lengths)], [1.0] * samples

    ahead = (
        OneStepAhead(*pipes, emulation.steps, lambda samples: [float(x["length"]) for x in samples])
        if off_policy
        else None
    )
    mark = time.monotonic()  # the last record's time: steps' wall time, bookkeeping included
    for step in range(emulation.steps):
        cpu = time.process_time()
        items, weights = items_of(step)
        if ahead is None:
            results, lag = [pipes[0].run(items, weights)], 0
            seconds = results[0].seconds
        else:
            done = ahead.step(step, items_of)
            results, seconds, lag = done.results, done.seconds, done.lag
        # the pipelines of the results (training first when off-policy), for the cost model
        ran = list(zip([ahead.training, ahead.generation] if ahead else pipes, results, strict=False))
        lengths = [item["length"] for item in items]
        sync_s = sync_weights(coordinator, profile, step)
        coordinator_cpu_s = time.process_time() - cpu
        step_s = seconds + sync_s
        useful = sum(s["useful_s"] for r in results for stats in r.finished.values() for s in stats)
        trained = results[0].outputs  # the actor's samples (training first when off-policy)
        carried = sum(1 for x in trained if x.get("lag"))  # partial rollouts: begun steps before
        stage_rows = [s for r in results for s in r.stages]
        record: dict[str, Any] = {
            "step": step + 1,
            "emulated": True,
            "profile": profile.name,
            "step_s": round(step_s, 4),
            "weight_sync_s": round(sync_s, 4),
            "samples": samples,
            "tokens": sum(lengths),
            # no on-policy schedule of these responses takes less (`Profile.on_policy_floor_s`)
            "on_policy_floor_s": round(profile.on_policy_floor_s(lengths) * emulation.time_scale, 4),
            "tokens_per_s": round(sum(lengths) / step_s, 1),
            "idle_fraction": round(max(0.0, 1.0 - useful / (workers * step_s)), 4),
            "coordinator_cpu_s": round(coordinator_cpu_s, 4),
            "coordinator_busy_fraction": round(coordinator_cpu_s / step_s, 4),
            "placement": results[0].placement,
            # the most updates between a trained token's generation and this update
            "policy_lag": lag + max((x.get("lag", 0) for x in trained), default=0),
            "samples_trained": len(trained),
            "partial_carried": carried,
            "phases_s": {s["component"]: round(s["busy_s"], 4) for s in stage_rows},
            "switch_s": round(sum(s["switch_s"] for s in stage_rows), 4),
            "micro_batch": {s["component"]: round(s["mean_micro_batch"], 2) for s in stage_rows},
        }
        if record["placement"] == predicted_for and predicted is not None:
            record["predicted_step_s"] = round(predicted, 4)
        # `step_s` is the pipelines' clock (from the step's stream declarations) plus the
        # sync; the wall time between records also holds this flow's own bookkeeping
        # (metrics, the prediction below, the next step's requests)
        now = time.monotonic()
        record["wall_s"], mark = round(now - mark, 4), now
        # each step calibrates the cost model for the next one (its micro-batch sizes move);
        # pipelines that run side by side take the longest one's time on ranks of their own,
        # and the sum of their times on shared ones (a rank runs its commands one at a time:
        # off-policy placed collocated by auto took 1.93 s, the longer one alone 1.58)
        spans = [predict(p, r, samples) for p, r in ran]
        ranks = [{reply["rank"] for replies in r.per_rank for reply in replies} for _, r in ran]
        shared = len(ranks) > 1 and bool(set.intersection(*ranks))
        predicted = (sum(spans) if shared else max(spans)) + sync_s
        predicted_for = record["placement"]
        history.append(record)
        metrics.write(step + 1, record)
        log.info(
            "step %d/%d %.3f s (sync %.3f) idle %.0f%% coordinator %.1f%% %s | %s",
            step + 1, emulation.steps, step_s, sync_s, 100 * record["idle_fraction"],
            100 * record["coordinator_busy_fraction"], record["placement"],
            " ".join(f"{k}:{v}" for k, v in record["micro_batch"].items()),
        )  # fmt: skip
    for pipe in pipes:
        pipe.close()
    metrics.close()
    print_table(
        f"EMULATED {profile.name} on {workers} worker ranks ({pipes[0].placement_label}"
        f"{', one-step off-policy' if off_policy else ''})",
        ["step", "step s", "predicted s", "idle", "coordinator", "placement"],
        [
            (str(r["step"]), f"{r['step_s']:.3f}", f"{r.get('predicted_step_s', float('nan')):.3f}",
             f"{100 * r['idle_fraction']:.0f}%", f"{100 * r['coordinator_busy_fraction']:.1f}%",
             r["placement"])
            for r in history
        ],
    )  # fmt: skip
    summary = {"emulated": True, "profile": profile.name, "placement": pipes[0].placement_label}
    return {"summary": {**summary, "off_policy_steps": emulation.off_policy_steps}}
