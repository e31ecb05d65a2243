"""The `embodied_ppo` flow: simulators on env ranks, the policy on policy ranks, PPO on actor ranks.

Per iteration: env + policy collect a rollout (`EnvWorker.rollout` and `PolicyWorker.serve`
at the same time), the actor trains on it (`ActorWorker.train`), the new weights go to the
policy ranks. With ``ppo.async_updates`` the next rollout is collected with the weights the last
one used while the actor trains — one update stale, importance-corrected by PPO's ratio against
the behaviour log-probs; the staleness of every update is in the metrics. Writes
``metrics.jsonl`` (one line per iteration), ``progress.png`` and the summary's headline figures
(``return_start``, ``return_end``, ``wall_seconds``).
"""

from __future__ import annotations

import time
from typing import Any

from rlinf_hpc.apps.embodied.placement import EmbodiedAuto
from rlinf_hpc.apps.embodied.protocol import CHANNEL
from rlinf_hpc.log import get_logger
from rlinf_hpc.runtime.checkpoint.manager import checkpoints_of
from rlinf_hpc.runtime.console import print_table
from rlinf_hpc.runtime.metrics import MetricsLog
from rlinf_hpc.scheduler import Coordinator

log = get_logger("embodied")


def sync_weights(coordinator: Coordinator, version: int) -> dict[str, float]:
    """Actor group rank 0 -> every policy rank (a binomial tree)."""
    placement = coordinator.placement
    started = time.monotonic()
    source = placement.ranks_of("actor")[0]
    targets = placement.ranks_of("policy")
    push = coordinator.group("actor").subset([0]).call("push_weights", targets)
    pull = coordinator.group("policy").call("pull_weights", source, version)
    sent = push.result()[0]
    pull.result()
    return {"seconds": time.monotonic() - started, "bytes": sent["bytes"] * len(targets)}


class _Rollout:
    """A rollout in flight: env ranks stepping, policy ranks serving."""

    def __init__(self, coordinator: Coordinator, iteration: int) -> None:
        steps = coordinator.config.ppo.rollout_steps
        self.started = time.monotonic()
        self.serving = coordinator.group("policy").call("serve")
        self.stepping = coordinator.group("env").call("rollout", iteration, steps)

    def result(self) -> dict[str, Any]:
        envs = self.stepping.result()
        served = self.serving.result()
        returns = [r for e in envs for r in e["returns"]]
        lengths = [n for e in envs for n in e["lengths"]]
        return {
            "env_steps": sum(e["env_steps"] for e in envs),
            "returns": returns,
            "lengths": lengths,
            "rollout_s": time.monotonic() - self.started,
            "env_wait_s": max(e["wait_s"] for e in envs),
            "env_step_s": max(e["step_s"] for e in envs),
            "policy_busy_s": max(s["busy_s"] for s in served),
            "policy_batch": sum(s["observations"] for s in served)
            / max(sum(s["batches"] for s in served), 1),
            # CPU seconds of the env and policy ranks, all of them (`_record`'s cpu_s)
            "rollout_cpu_s": sum(e["cpu_s"] for e in envs) + sum(s["cpu_s"] for s in served),
        }


def embodied_ppo_flow(coordinator: Coordinator) -> dict[str, Any]:
    config = coordinator.config
    ppo, env = config.ppo, config.env
    if CHANNEL not in config.channels:
        capacity = 2 * env.pipeline_stages
        coordinator.create_channel(CHANNEL, "env", "policy", policy="shortest_queue", capacity=capacity)
    run_dir = coordinator.run_dir
    checkpoints = checkpoints_of(coordinator)
    auto = EmbodiedAuto(coordinator)  # placement.mode = "auto": warm up shared, then decide
    resumed = checkpoints.restore()
    if resumed is None:
        history: list[dict[str, Any]] = []
        episodes: list[float] = []
        env_steps, first = 0, 0
        collected: dict[str, Any] | None = None  # the rollout the next update trains on
        sync = sync_weights(coordinator, 0)
    else:  # env states, noise and actor restored; the policy takes the actor's weights
        history, episodes, env_steps = resumed["history"], resumed["episodes"], resumed["env_steps"]
        first, collected = len(history), resumed["collected"]
        auto.load_state_dict(resumed.get("auto"))
        sync = sync_weights(coordinator, first)
        if collected is not None:  # asynchronous: a rollout collected before the stop, not trained on
            coordinator.group("env").call("resend", first).result()
    metrics = MetricsLog(run_dir, resume_after=first if resumed else None)
    started = time.monotonic()

    def flow_state() -> dict[str, Any]:
        return {
            "history": history,
            "episodes": episodes,
            "env_steps": env_steps,
            "collected": collected,
            "auto": auto.state_dict(),
        }

    for iteration in range(first, ppo.iterations):
        step_started, step_cpu = time.monotonic(), time.process_time()
        if collected is None:
            collected = _Rollout(coordinator, iteration).result()
        lr = ppo.lr * (1 - iteration / ppo.iterations) if ppo.anneal_lr else ppo.lr
        following = None
        # auto's warm-up is synchronous: a rollout beside an update on shared ranks only takes
        # turns with it, and the decision moves ranks, which a rollout in flight must not see
        if ppo.async_updates and not auto.warming_up and iteration + 1 < ppo.iterations:
            pending = _Rollout(coordinator, iteration + 1)  # with the weights `collected` used
            trained = coordinator.group("actor").call("train", iteration, lr).result()
            sync = sync_weights(coordinator, iteration + 1)
            following = pending.result()
        else:
            trained = coordinator.group("actor").call("train", iteration, lr).result()
            sync = sync_weights(coordinator, iteration + 1)
        env_steps += collected["env_steps"]
        episodes += collected["returns"]
        record = _record(iteration, collected, trained, sync, env_steps, episodes, step_started, started)
        # every rank's CPU seconds for this update's work: its rollout, its training, this rank's
        # own part; over the cores the job has, the least an iteration can take on them
        train_cpu_s = sum(t["train_cpu_s"] for t in trained)
        rollout_cpu_s = collected.get("rollout_cpu_s") or 0.0
        record["cpu_s"] = rollout_cpu_s + train_cpu_s + time.process_time() - step_cpu
        record["placement"] = auto.label
        history.append(record)
        metrics.write(iteration + 1, record)
        _log_iteration(record, ppo.iterations)
        collected = following
        if auto.after_iteration(record):  # auto moved policy and actor: new policy ranks need weights
            sync_weights(coordinator, iteration + 1)
        checkpoints.step_finished(iteration + 1, flow_state, (), record["iteration_s"])
    checkpoints.finish(ppo.iterations, flow_state)
    metrics.close()
    wall = time.monotonic() - started
    firsts = next((r["episode_returns"] for r in history if r["episode_returns"]), [])
    summary = {
        "env_id": env.id,
        "iterations": ppo.iterations,
        "env_steps": env_steps,
        "env_steps_per_s": env_steps / max(wall, 1e-9),
        "return_start": sum(firsts) / len(firsts) if firsts else None,
        "return_end": _recent_mean(episodes),
        "episodes": len(episodes),
        "async_updates": ppo.async_updates,
        "max_staleness_seen": max((r["staleness"] for r in history), default=0),
        "mean_iteration_s": sum(r["iteration_s"] for r in history) / max(len(history), 1),
        "resumed_from_iteration": checkpoints.resumed_step if resumed else None,
        "checkpoints": checkpoints.saved,
        "wall_seconds": round(wall, 3),
        "placement": auto.label,
    }
    if run_dir is not None:
        plot_returns(history, run_dir / "progress.png", f"{config.job.name}: {env.id}")
    print_table(
        f"embodied PPO on {env.id}",
        ["iterations", "env steps", "steps/s", "return start", f"return end (last {WINDOW})", "wall s"],
        [(
            str(ppo.iterations), str(env_steps), f"{summary['env_steps_per_s']:.0f}",
            f"{summary['return_start'] or 0:.1f}", f"{summary['return_end'] or 0:.1f}", f"{wall:.1f}",
        )],
    )  # fmt: skip
    return {"summary": summary}


WINDOW = 20  #: episodes in the running mean of the returns (and in return_end)


def _recent_mean(episodes: list[float]) -> float | None:
    recent = episodes[-WINDOW:]
    return sum(recent) / len(recent) if recent else None


#: What a rollout's result puts into its iteration's record.
_ROLLOUT_FIGURES = ("rollout_s", "env_wait_s", "env_step_s", "policy_busy_s", "policy_batch", "rollout_cpu_s")


def _record(
    iteration: int,
    collected: dict[str, Any],
    trained: list[dict[str, Any]],
    sync: dict[str, float],
    env_steps: int,
    episodes: list[float],
    step_started: float,
    started: float,
) -> dict[str, Any]:
    returns = collected["returns"]
    means = {k: sum(t[k] for t in trained) / len(trained) for k in trained[0] if k not in ("version",)}
    return {
        "iteration": iteration + 1,
        "env_steps": env_steps,
        "episode_returns": returns,
        "return_mean": sum(returns) / len(returns) if returns else None,
        "return_recent": _recent_mean(episodes),
        "episode_length_mean": sum(collected["lengths"]) / len(collected["lengths"]) if returns else None,
        **{k: collected.get(k) for k in _ROLLOUT_FIGURES},  # a checkpoint's may predate one
        **means,
        "staleness": max(t["staleness"] for t in trained),
        "weight_sync_s": sync["seconds"],
        "iteration_s": time.monotonic() - step_started,
        "elapsed_s": time.monotonic() - started,
    }


def _log_iteration(record: dict[str, Any], iterations: int) -> None:
    recent = record["return_recent"]
    log.info(
        "iteration %d/%d return %s (last %d episodes) | %d env steps, rollout %.2f s train %.2f s "
        "sync %.3f s, staleness %d, kl %.4f",
        record["iteration"], iterations, "-" if recent is None else f"{recent:.1f}", WINDOW,
        record["env_steps"], record["rollout_s"], record["train_s"], record["weight_sync_s"],
        record["staleness"], record["approx_kl"],
    )  # fmt: skip


def plot_returns(history: list[dict[str, Any]], path: Any, title: str) -> None:
    """Episodic returns against env steps: every finished episode, and the 20-episode mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    xs = [r["env_steps"] for r in history if r["return_recent"] is not None]
    axis.plot(
        xs,
        [r["return_recent"] for r in history if r["return_recent"] is not None],
        label=f"mean of last {WINDOW} episodes",
    )
    for record in history:
        axis.scatter(
            [record["env_steps"]] * len(record["episode_returns"]),
            record["episode_returns"],
            s=4,
            alpha=0.3,
            color="grey",
        )
    axis.set_xlabel("env steps")
    axis.set_ylabel("episodic return")
    axis.grid(alpha=0.3)
    axis.legend()
    axis.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
