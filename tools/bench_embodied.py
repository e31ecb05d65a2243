"""Embodied PPO: env steps/s of the env/policy split against gymnasium's own vector env, the
split with and without pipelining, and asynchronous against synchronous parameter updates.

    python tools/bench_embodied.py [--env Hopper-v5] [--iterations 12] [--repeats 3] [--json out.json]

Ratios (required bounds in REQUIRED):
- ``split_vs_vector_env``: rollout env steps/s of the job (2 env ranks, 1 policy rank, 2
  pipeline groups) / a single process stepping a ``gymnasium.vector.SyncVectorEnv`` of the same
  instances with the same policy, one thread (the baseline a user writes first; same box).
- ``pipelined_vs_unpipelined``: rollout env steps/s with ``env.pipeline_stages = 2`` / ``1``.
- ``async_vs_sync``: mean wall seconds per update, synchronous / asynchronous updates; the final
  returns of both (mean of the last 20 episodes) are reported next to it, at equal env steps.
  Beside it, what the box allows (``async_vs_sync_ceiling``): the synchronous update's seconds
  over the least an asynchronous one can take on these cores — every rank's CPU seconds of an
  update (measured in the synchronous job) over the cores, or its longer chain alone if more —
  and ``async_floor_vs_async``, how close async came to that floor (1.0: the cores are full).

Each job runs the env's shipped config (`CONFIGS`; Hopper: 10 epochs x 16 minibatches, as PPO
baselines for MuJoCo train) with the env count and rollout length above; async updates can only
overlap what the update trains, so a config with little training (CartPole's 4 x 4) bounds
``async_vs_sync`` near 1 + train / rollout whatever the runtime does.

``--repeats N`` (default 3, ~5 minutes for Hopper) runs the three jobs N times, alternated, and
takes each figure's median (each round's ratios are in the JSON): on a 2-core box one job's
seconds per update swing by 20-50% within minutes. ``--png`` (default beside ``--json``):
return against env steps and seconds per iteration, sync and async, from the first round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import check_ratios, curves_path, plot_curves, write_json

REPO = Path(__file__).resolve().parents[1]
#: The shipped config of each env (its PPO settings: epochs, minibatches, learning rate); any
#: other env id runs the CartPole config with ``env.id`` set.
CONFIGS = {
    "Hopper-v5": REPO / "configs" / "embodied_ppo_hopper.toml",
    "CartPole-v1": REPO / "configs" / "embodied_ppo_cartpole.toml",
}
REQUIRED = {
    "split_vs_vector_env": (">=", 1.0),
    "pipelined_vs_unpipelined": (">=", 1.1),
    "async_vs_sync": (">=", 1.3),
}


def run_job(config: Path, env_id: str, iterations: int, out: Path, sets: list[str]) -> dict:
    """One embodied job; its per-iteration records and summary."""
    args = [
        str(Path(sys.executable).parent / "rlinf-hpc"), "run", str(config), "--run-dir", str(out),
        f"--set=env.id={env_id}", f"--set=ppo.iterations={iterations}", *[f"--set={s}" for s in sets],
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode:
        sys.exit(f"job failed ({' '.join(sets)}):\n{done.stderr[-3000:]}")
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {"records": records, "summary": json.loads((out / "summary.json").read_text())}


def rollout_rate(job: dict) -> float:
    """Env steps per second of rollout time (training excluded), after the first iteration."""
    first, *rest = job["records"]
    per_rollout = first["env_steps"]  # every rollout is the same size
    return per_rollout * len(rest) / sum(r["rollout_s"] for r in rest)


def async_floor(job: dict, cpus: int) -> dict[str, float]:
    """The least an asynchronous update can take on this box, from a synchronous job's
    iterations after the first: every rank's CPU seconds of an update over the cores (two on the
    project's box: the env ranks' stepping, the policy's serving, the actor's update and the
    coordinator's part, which async only overlaps), and no less than its longer chain alone
    (the rollout or the update)."""
    rest = job["records"][1:]
    mean = lambda key: sum(r[key] for r in rest) / len(rest)  # noqa: E731
    cpu = mean("cpu_s")
    floor = max(cpu / cpus, mean("rollout_s"), mean("train_s"))
    return {"cpu_s": cpu, "floor_s": floor, "ceiling": mean("iteration_s") / floor}


def curves(job: dict) -> dict[str, list[float]]:
    """Per iteration: env steps so far, the return of the last 20 episodes, seconds."""
    records = [r for r in job["records"] if r["return_recent"] is not None]
    return {
        "env_steps": [r["env_steps"] for r in records],
        "return_recent": [r["return_recent"] for r in records],
        "iteration_s": [r["iteration_s"] for r in records],
    }


def plot_async(
    sync: dict[str, list[float]], asynchronous: dict[str, list[float]], env_id: str, path: Path
) -> None:
    """Return against env steps (equal data: is async's staleness costing learning?) and each
    iteration's seconds, synchronous and asynchronous updates."""
    runs = {"sync updates": sync, "async updates": asynchronous}
    plot_curves(
        path,
        f"embodied PPO on {env_id}: asynchronous against synchronous parameter updates",
        [
            (
                "env steps",
                "return (last 20 episodes)",
                {k: (c["env_steps"], c["return_recent"]) for k, c in runs.items()},
            ),
            (
                "env steps",
                "seconds per iteration",
                {k: (c["env_steps"], c["iteration_s"]) for k, c in runs.items()},
            ),
        ],
    )
    print(f"curves: {path}")


def vector_env_rate(config: Path, env_id: str, instances: int, steps: int) -> float:
    """Env steps/s of one process: SyncVectorEnv + the same policy as the job's (its MLP and,
    if the config normalizes observations, the normalization), one thread."""
    import gymnasium as gym
    import numpy as np
    import torch

    from rlinf_hpc.apps.embodied.envs import check_env_id
    from rlinf_hpc.apps.embodied.model import build_model
    from rlinf_hpc.config.loader import load_config

    torch.set_num_threads(1)
    spec = check_env_id(env_id)
    model = build_model(load_config(config, [f"env.id={env_id}"]))
    envs = gym.make_vec(env_id, num_envs=instances, vectorization_mode="sync")
    obs, _ = envs.reset(seed=0)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for _ in range(steps):
        noise = rng.random(instances) if spec.discrete else rng.standard_normal((instances, spec.action_dim))
        actions, _ = model.act(
            torch.as_tensor(obs, dtype=torch.float32), torch.as_tensor(noise, dtype=torch.float32)
        )
        actions = actions.numpy() if spec.discrete else np.clip(actions.numpy(), spec.low, spec.high)
        obs, *_ = envs.step(actions)
    envs.close()
    return instances * steps / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--env", default="Hopper-v5", help="gymnasium id (default Hopper-v5: sim cost dominates)"
    )
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--envs-per-rank", type=int, default=16)
    parser.add_argument("--rollout-steps", type=int, default=128)
    parser.add_argument(
        "--policy-batching", choices=("request", "merge"), default="request", help="ppo.policy_batching"
    )
    parser.add_argument(
        "--config",
        type=Path,
        help="job config (default: the env's shipped config, see CONFIGS; its [ppo] decides how "
        "long an update trains, hence what async updates can overlap)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3,
        help="rounds of the three jobs, alternated; the ratios are of the rounds' medians",
    )  # fmt: skip
    parser.add_argument("--json", help="write ratios and raw figures here")
    parser.add_argument(
        "--png", help="async/sync curves (default: bench_embodied_curves.png beside --json, else here)"
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    config = args.config or CONFIGS.get(args.env, CONFIGS["CartPole-v1"])
    base = [
        f"env.envs_per_rank={args.envs_per_rank}",
        f"ppo.rollout_steps={args.rollout_steps}",
        f"ppo.policy_batching={args.policy_batching}",
    ]
    variants = {
        "pipelined": [*base, "env.pipeline_stages=2"],
        "unpipelined": [*base, "env.pipeline_stages=1"],
        "async": [*base, "env.pipeline_stages=2", "ppo.async_updates=true"],
    }
    rounds: list[dict[str, float]] = []
    first: dict[str, dict] = {}
    cpus = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.repeats):  # alternated: a quiet or busy minute of the box hits all
            jobs = {
                name: run_job(config, args.env, args.iterations, Path(tmp) / f"{name}-{index}", sets)
                for name, sets in variants.items()
            }
            first = first or jobs
            rounds.append({
                "split": rollout_rate(jobs["pipelined"]),
                "unpipelined": rollout_rate(jobs["unpipelined"]),
                "vector": vector_env_rate(config, args.env, 2 * args.envs_per_rank, args.rollout_steps * 2),
                "sync_update": jobs["pipelined"]["summary"]["mean_iteration_s"],
                "async_update": jobs["async"]["summary"]["mean_iteration_s"],
                **async_floor(jobs["pipelined"], cpus),
            })  # fmt: skip
    keys = ("split", "unpipelined", "vector", "sync_update", "async_update", "cpu_s", "floor_s", "ceiling")
    split, unpipelined, vector, sync_update, async_update, cpu_s, floor_s, ceiling = (
        statistics.median(r[k] for r in rounds) for k in keys
    )
    pipelined, asynchronous = first["pipelined"], first["async"]
    ratios = {
        "split_vs_vector_env": split / vector,
        "pipelined_vs_unpipelined": split / unpipelined,
        "async_vs_sync": sync_update / async_update,
    }
    raw = {
        "env": args.env,
        "config": str(config.relative_to(REPO) if config.is_relative_to(REPO) else config),
        "train_s_per_update": sum(r["train_s"] for r in pipelined["records"][1:])
        / max(1, len(pipelined["records"]) - 1),
        "policy_batching": args.policy_batching,
        "env_steps_per_iteration": 2 * args.envs_per_rank * args.rollout_steps,
        "repeats": args.repeats,
        "split_rollout_steps_per_s": split,
        "unpipelined_rollout_steps_per_s": unpipelined,
        "vector_env_steps_per_s": vector,
        "sync_s_per_update": sync_update,
        "async_s_per_update": async_update,
        # what the cores allow async (`async_floor`): the ratio's ceiling on this box, and how
        # close async came to that floor
        "cpu_s_per_update": cpu_s,
        "async_floor_s": floor_s,
        "async_vs_sync_ceiling": ceiling,  # its iterations after the first over the floor
        "async_floor_vs_async": floor_s / async_update,
        "sync_return_end": pipelined["summary"]["return_end"],
        "async_return_end": asynchronous["summary"]["return_end"],
        "cpus": cpus,
        # each round's ratios (the medians above make the reported ones)
        "async_vs_sync_rounds": [r["sync_update"] / r["async_update"] for r in rounds],
        "pipelined_vs_unpipelined_rounds": [r["split"] / r["unpipelined"] for r in rounds],
        "split_vs_vector_env_rounds": [r["split"] / r["vector"] for r in rounds],
        "sync_curve": curves(pipelined),
        "async_curve": curves(asynchronous),
    }
    png = curves_path(args.png, args.json, "bench_embodied_curves.png")
    plot_async(raw["sync_curve"], raw["async_curve"], args.env, png)
    rows, ok = check_ratios(ratios, REQUIRED, not_yet_met=tuple(REQUIRED))  # see BENCHMARKS.md
    from rlinf_hpc.runtime.console import print_table

    print_table(
        f"embodied PPO on {args.env} ({raw['cpus']} cpus)", ["ratio", "value", "required", "status"], rows
    )
    for key, value in raw.items():
        if key.endswith("_curve"):
            continue
        print(f"  {key}: {value:.3f}" if isinstance(value, float) else f"  {key}: {value}")
    write_json(args.json, {"ratios": ratios, "raw": raw})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
