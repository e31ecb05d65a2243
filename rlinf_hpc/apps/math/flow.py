"""The `math_grpo` flow: arithmetic (or GSM8K-style) reasoning trained with GRPO or PPO.

The macro flow, as a user would write it: warm start the actor, sync its weights to rollout and
inference (and, for PPO, once to the critic), then per step feed prompts through rollout ->
reward -> inference (-> critic) -> actor (a `Pipeline`: micro-batches, any placement), sync
again, evaluate now and then. With ``grpo.off_policy_steps = 1`` the generation (rollout ->
reward -> inference) and the training ((critic ->) actor) are two pipelines: step t's update
runs beside step t+1's generation, which uses the weights from before that update (one step
stale, `policy_lag` in the metrics; the behaviour policy's log-probs, which inference computed
with the rollout's weights, weight the decoupled loss: `grpo.decoupled_loss`). ``grpo.control``
swaps the RL update for a frozen actor or supervised steps, the controls of
tools/bench_learning.py. Writes
``metrics.jsonl`` (one line per step), ``progress.png`` and the summary's headline figures.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rlinf_hpc.apps.math.plots import plot_training
from rlinf_hpc.apps.math.tasks import make_task
from rlinf_hpc.errors import UserError
from rlinf_hpc.log import get_logger
from rlinf_hpc.runtime.checkpoint.manager import checkpoints_of
from rlinf_hpc.runtime.console import print_table
from rlinf_hpc.runtime.metrics import MetricsLog
from rlinf_hpc.scheduler import Coordinator, Pipeline, StepResult
from rlinf_hpc.scheduler.off_policy import OneStepAhead

log = get_logger("grpo")


def check_inputs(coordinator: Coordinator) -> Any:
    """What depends on the placement (actor ranks); returns the task."""
    config = coordinator.config
    task = make_task(config.task, config.job.seed)
    actor_ranks = len(coordinator.placement.ranks_of("actor"))
    samples = config.grpo.prompts_per_step * config.grpo.group_size
    uneven = samples % (actor_ranks * config.grpo.minibatches) or config.sft.batch_size % actor_ranks
    if uneven and config.placement.mode != "auto":  # auto's choices are split as evenly as possible
        raise UserError(
            f"{samples} samples per step (or sft.batch_size {config.sft.batch_size}) cannot be split "
            f"evenly over the {actor_ranks} actor rank(s) this placement gives; adjust "
            "grpo.prompts_per_step / grpo.group_size / sft.batch_size."
        )
    return task


def sync_weights(
    coordinator: Coordinator, names: tuple[str, ...] = ("rollout", "inference")
) -> dict[str, float]:
    """Actor group rank 0 -> every rank of ``names`` (rollout and inference each step; the
    critic once, for its warm-started start); returns seconds and bytes."""
    placement = coordinator.placement
    source = placement.ranks_of("actor")[0]
    targets = [(rank, name) for name in names for rank in placement.ranks_of(name)]
    started = time.monotonic()
    actor = coordinator.group("actor")
    sharded = coordinator.config.grpo.train_backend == "fsdp2"  # every shard joins the gathers
    push = (actor if sharded else actor.subset([0])).call("push_weights", targets)
    pulls = [coordinator.group(name).call("pull_weights", source) for name in names]
    sent = push.result()[0]
    for pull in pulls:
        pull.result()
    return {"seconds": time.monotonic() - started, "bytes": sent["bytes"] * len(targets)}


def evaluate(coordinator: Coordinator, problems: list[Any]) -> dict[str, Any]:
    """Greedy accuracy on the held-out problems, split over the rollout ranks."""
    rollout = coordinator.group("rollout")
    rows = [(p.uid, p.prompt, p.answer) for p in problems]
    replies = rollout.call_each(
        "evaluate", [(rows[i :: len(rollout)],) for i in range(len(rollout))]
    ).result()
    correct = sum(r["correct"] for r in replies)
    return {"accuracy": correct / len(rows), "correct": correct, "examples": replies[0]["examples"]}


def _warm_start(coordinator: Coordinator, eval_set: list[Any]) -> tuple[dict[str, Any], float]:
    """Supervised warm start, first weight sync, reference policy, held-out accuracy."""
    warm = coordinator.group("actor").call("warm_start").result()[0]
    if warm.get("steps") == 0 and not warm["cached"]:
        log.info("no warm start (sft.steps = 0): RL starts from the model as loaded")
    else:
        log.info(
            "warm start %s in %.1f s%s", "loaded from cache" if warm["cached"] else "trained",
            warm["seconds"], f" (final loss {warm['loss']:.3f})" if warm["loss"] is not None else "",
        )  # fmt: skip
    critic = ("critic",) if "critic" in coordinator.placement.groups else ()
    sync_weights(coordinator, ("rollout", "inference", *critic))  # the critic starts from the policy
    if coordinator.config.grpo.kl_coef > 0:  # the KL's reference: a frozen copy of the policy
        coordinator.group("inference").call("set_reference").result()
    accuracy = evaluate(coordinator, eval_set)["accuracy"]
    log.info("held-out accuracy after warm start: %.1f%% (%d problems)", 100 * accuracy, len(eval_set))
    return warm, accuracy


def math_grpo_flow(coordinator: Coordinator) -> dict[str, Any]:
    """The main job. Checkpoints (`rlinf_hpc.runtime.checkpoint`) hold the actor's model and
    optimizer, the reference policy, every rank's RNG and micro-batch sizes, `auto`'s decision
    and this flow's history; the data position is the step (problems and sampling seeds are
    functions of the step), so a resume continues exactly where the checkpoint was taken."""
    config = coordinator.config
    grpo = config.grpo
    task = check_inputs(coordinator)
    run_dir: Path | None = coordinator.run_dir
    checkpoints = checkpoints_of(coordinator)
    eval_set = task.eval_problems()

    pipes = build_pipelines(coordinator)
    ahead = OneStepAhead(*pipes, grpo.steps) if len(pipes) == 2 else None
    resumed = checkpoints.restore(pipes)
    if resumed is None:
        warm, start_accuracy = _warm_start(coordinator, eval_set)
        history: list[dict[str, Any]] = []
        evals = [(0, start_accuracy)]
        first_step, rl_before = 0, 0.0
    else:
        sync_weights(coordinator)  # rollout and inference take the restored actor's weights
        warm, history, rl_before = resumed["warm_start"], resumed["history"], resumed["rl_seconds"]
        evals = [tuple(e) for e in resumed["evals"]]
        first_step = len(history)  # steps finished (the history has one record per step)
        start_accuracy = evals[0][1]
        if ahead is not None:
            ahead.load_state_dict(resumed)  # the samples it had generated ahead
        if first_step >= grpo.steps:
            log.info(
                "the checkpoint is at step %d of %d: nothing left to train (raise grpo.steps to go "
                "on, or --resume never to start afresh)", first_step, grpo.steps,
            )  # fmt: skip
    metrics = MetricsLog(run_dir, grpo.tensorboard, resume_after=first_step if resumed else None)
    started = time.monotonic()

    def flow_state() -> dict[str, Any]:
        return {
            "history": history,
            "evals": [list(e) for e in evals],
            "warm_start": warm,
            "rl_seconds": rl_before + time.monotonic() - started,
            **(ahead.state_dict() if ahead is not None else {}),
        }

    def items_of(step: int) -> tuple[list[dict[str, Any]], None]:
        problems = task.train_batch(step, grpo.prompts_per_step)
        return [{"uid": p.uid, "step": step, "prompt": p.prompt, "answer": p.answer} for p in problems], None

    examples: list[dict[str, Any]] = []  # the last evaluation's first answers, prompts as rendered
    for step in range(first_step, grpo.steps):
        if ahead is None:
            results = [pipes[0].run(*items_of(step))]
            seconds, lag = results[0].seconds, 0
        else:
            done = ahead.step(step, items_of)
            results, seconds, lag = done.results, done.seconds, done.lag
        finished = {k: v for r in results for k, v in r.finished.items()}
        stages = [s for r in results for s in r.stages]
        update = finished["actor"][0]
        critic = finished["critic"][0] if "critic" in finished else {}
        sync = sync_weights(coordinator)
        record: dict[str, Any] = {
            "step": step + 1,
            **{k: v for k, v in update.items() if k != "update_s"},
            **{k: v for k, v in critic.items() if k != "critic_update_s"},
            "policy_lag": lag,
            "step_s": seconds + sync["seconds"],
            "tokens_per_s": update["tokens"] / max(seconds, 1e-9),
            "weight_sync_s": sync["seconds"],
            "weight_sync_bytes": sync["bytes"],
            "placement": results[0].placement,
            "phases_s": {
                **{s["component"]: round(s["busy_s"], 4) for s in stages},
                "actor": round(update["update_s"], 4),  # collecting is free; the update is not
                **({"critic_update": round(critic["critic_update_s"], 4)} if critic else {}),
            },
            "switch_s": round(sum(s["switch_s"] for s in stages), 4),
            "bubble_fraction": bubble_fraction(stages, seconds),
            "micro_batch": {s["component"]: round(s["mean_micro_batch"], 2) for s in stages},
        }
        if (step + 1) % grpo.eval_every == 0 or step + 1 == grpo.steps:
            evaluation = evaluate(coordinator, eval_set)
            record["eval_accuracy"], examples = evaluation["accuracy"], evaluation["examples"]
            evals.append((step + 1, record["eval_accuracy"]))
        history.append(record)
        metrics.write(step + 1, record)
        _log_step(record, grpo.steps)
        checkpoints.step_finished(step + 1, flow_state, pipes, record["step_s"])
    checkpoints.finish(grpo.steps, flow_state, pipes)
    for pipe in pipes:
        pipe.close()
    metrics.close()
    rl_seconds = rl_before + time.monotonic() - started
    end_accuracy = evals[-1][1]
    if run_dir is not None:
        plot_training(history, evals, run_dir / "progress.png", config.job.name)
    print_table(
        f"math {_label(grpo)}: held-out accuracy (greedy)",
        ["", "accuracy", "problems", "reward (sampled)"],
        [
            ("after warm start", f"{100 * start_accuracy:.1f}%", str(len(eval_set)), "-"),
            (f"after {grpo.steps} {_label(grpo)} steps", f"{100 * end_accuracy:.1f}%", str(len(eval_set)),
             f"{history[-1]['reward']:.3f}"),
        ],
    )  # fmt: skip
    summary = {
        "eval_accuracy_start": start_accuracy,
        "eval_accuracy_end": end_accuracy,
        "eval_accuracy_gain": end_accuracy - start_accuracy,
        "steps": grpo.steps,
        "algorithm": grpo.algorithm,
        "control": grpo.control,
        "rl_seconds": round(rl_seconds, 3),
        "warm_start": warm,
        "placement": pipes[0].placement_label,
        "off_policy_steps": grpo.off_policy_steps,
        "mean_policy_lag": sum(r.get("policy_lag", 0) for r in history) / len(history),
        "mean_step_s": sum(r["step_s"] for r in history) / len(history),
        "tokens_per_s": sum(r["tokens"] for r in history) / max(sum(r["step_s"] for r in history), 1e-9),
        "resumed_from_step": checkpoints.resumed_step if resumed else None,
        "checkpoints": checkpoints.saved,
        "eval_examples": examples,
    }
    return {"summary": summary, "evals": evals, "final_reward": history[-1]["reward"]}


def _label(grpo: Any) -> str:
    """``GRPO``, ``PPO``, or the control a benchmark runs instead of RL."""
    return grpo.algorithm.upper() if grpo.control == "none" else f"{grpo.control}-control"


def _step_tokens(result: StepResult) -> float:
    """The tokens of a step's responses, `auto`'s unit of work: those the actor trained on
    (each actor rank gathers the step's groups), or those generation passed on (off-policy)."""
    if "actor" in result.finished:
        return float(result.finished["actor"][0]["tokens"])
    return float(sum(group["tokens"] for group in result.outputs))


def build_pipelines(coordinator: Coordinator) -> list[Pipeline]:
    """On-policy: one pipeline, rollout -> reward -> inference (-> critic) -> actor. One-step
    off-policy: generation (rollout -> reward -> inference, whose outputs come back to the
    coordinator) and training ((critic ->) actor), which run side by side."""
    grpo = coordinator.config.grpo
    generation = [("rollout", "generate", None), ("reward", "score", None), ("inference", "logprobs", None)]
    training = [("critic", "values", "update")] if grpo.algorithm == "ppo" else []
    training.append(("actor", "collect", "update"))
    if grpo.off_policy_steps:
        parts = [("grpo_gen", generation), ("grpo_train", training)]
    else:
        parts = [("grpo", generation + training)]
    pipes = []
    for name, stages in parts:
        pipe = Pipeline(coordinator, name, work=_step_tokens)
        for component, method, finish in stages:
            scales = finish is not None and _update_scales(coordinator, component)
            pipe.stage(component, method, finish=finish, finish_scales=scales)
        pipes.append(pipe)
    return pipes


def _update_scales(coordinator: Coordinator, component: str) -> bool:
    """Whether ``auto`` should model a trainer's finish (`update`: epochs over the samples the
    rank collected) as work per sample: yes on accelerators, where one rank's update over N/r
    samples takes about 1/r of N's. Not on CPU ranks: the warm-up's wait for cores is taken out
    of what it measured (`scheduler.contention`), but at this project's sizes a CPU update's
    cost is about half per optimizer step, not per sample (per-op overhead: 128 samples on each of
    4 actor ranks took 0.45 s of CPU, all 512 on one rank 1.0-1.2 s, not 1.8): per sample,
    the split was predicted at 3.1 s against 1.4 measured on 2 cores; a constant finish comes
    closer (1.08-1.11 s predicted; off-policy 0.66 against 1.1), and `auto` measures the split
    before it keeps it (`placement.auto_verify_steps`). A finish measured at two shares would
    lift this."""
    return coordinator.config.components[component].device != "cpu"


def bubble_fraction(stages: list[dict[str, Any]], seconds: float) -> float:
    """Share of the step's rank-time (every worker rank of a stage, step wall time) in which
    no stage did work: 1 - (busy + finish time of every stage) / (step time x ranks)."""
    ranks = {rank for stage in stages for rank in stage["ranks"]}
    work = sum(s["busy_s"] + s["finish_s"] for s in stages)
    return round(max(0.0, 1.0 - work / max(seconds * len(ranks), 1e-9)), 4)


def _log_step(record: dict[str, Any], steps: int) -> None:
    phases = " ".join(f"{k} {v:.2f}" for k, v in record["phases_s"].items())
    evaluated = f" eval {100 * record['eval_accuracy']:.1f}%" if "eval_accuracy" in record else ""
    log.info(
        "step %d/%d reward %.3f acc %.1f%%%s | %.0f tok/s step %.2f s (%s sync %.3f)",
        record["step"], steps, record["reward"], 100 * record["sample_accuracy"], evaluated,
        record["tokens_per_s"], record["step_s"], phases, record["weight_sync_s"],
    )  # fmt: skip
