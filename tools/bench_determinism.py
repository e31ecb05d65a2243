#!/usr/bin/env python
"""What reproducibility costs: the tiny math GRPO job with batch-invariant forwards
(``grpo.batch_invariant = true``, the default) against whole micro-batches per forward, and
whether two runs of one config side by side on a loaded box agree to the last bit.

    python tools/bench_determinism.py [--steps 12] [--twins] [--json PATH]

- ``invariant_step_vs_plain``: median step time (steps 2 on) with batch-invariant forwards /
  without, the two runs one after the other on an idle box (same ranks, same config).
- ``--twins``: two runs of each mode at once with a CPU hog beside them; the count of metric
  values (losses, rewards, KL, gradient norms; not times) that differ between the two runs of a
  mode, and at how many steps their elastic micro-batch sizes differed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchlib import check_ratios, write_json

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
REQUIRED = {"invariant_step_vs_plain": ("<=", 1.25)}
TIMES = ("tokens_per_s", "phases_s", "bubble_fraction", "micro_batch")


def _start(run_dir: Path, steps: int, invariant: bool) -> subprocess.Popen[bytes]:
    sets = [
        f"grpo.steps={steps}",
        f"grpo.eval_every={steps}",
        f"grpo.batch_invariant={str(invariant).lower()}",
    ]
    args = [
        str(BIN / "rlinf-hpc"),
        "run",
        str(REPO / "configs/math_grpo_tiny.toml"),
        "--run-dir",
        str(run_dir),
    ]
    for item in sets:
        args += ["--set", item]
    log = (run_dir.parent / f"{run_dir.name}.out").open("wb")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _values(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if not (k.endswith("_s") or k in TIMES)}


def _check(proc: subprocess.Popen[bytes], run_dir: Path) -> None:
    if proc.wait() != 0:
        log = run_dir.parent / f"{run_dir.name}.out"
        raise SystemExit(f"the job in {run_dir} failed:\n{log.read_text()[-3000:]}")


def step_times(work: Path, steps: int) -> dict[str, dict[str, float]]:
    out = {}
    for invariant in (False, True):
        run_dir = work / f"time-{'invariant' if invariant else 'plain'}"
        proc = _start(run_dir, steps, invariant)
        _check(proc, run_dir)
        records = _metrics(run_dir)[1:]  # step 1 warms up
        out["invariant" if invariant else "plain"] = {
            "step_s": statistics.median(r["step_s"] for r in records),
            "rollout_s": statistics.median(r["phases_s"]["rollout"] for r in records),
            "inference_s": statistics.median(r["phases_s"]["inference"] for r in records),
        }
    return out


def twins(work: Path, steps: int) -> dict[str, dict[str, int]]:
    out = {}
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for invariant in (True, False):
            name = "invariant" if invariant else "plain"
            dirs = [work / f"twin-{name}-{i}" for i in (0, 1)]
            procs = [_start(d, steps, invariant) for d in dirs]
            for proc, run_dir in zip(procs, dirs, strict=True):
                _check(proc, run_dir)
            a, b = (_metrics(d) for d in dirs)
            differing = sum(
                1
                for ra, rb in zip(a, b, strict=True)
                for k, v in _values(ra).items()
                if _values(rb).get(k) != v
            )
            sizes = sum(ra["micro_batch"] != rb["micro_batch"] for ra, rb in zip(a, b, strict=True))
            first = next(
                (ra["step"] for ra, rb in zip(a, b, strict=True) if _values(ra) != _values(rb)), None
            )
            out[name] = {"differing_values": differing, "first_differing_step": first, "size_changes": sizes}
    finally:
        hog.kill()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--twins", action="store_true", help="also run each mode twice at once, loaded")
    parser.add_argument("--json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        times = step_times(Path(tmp), args.steps)
        pairs = twins(Path(tmp), args.steps) if args.twins else None
    ratios = {"invariant_step_vs_plain": times["invariant"]["step_s"] / times["plain"]["step_s"]}
    print(f"{'mode':10} {'step s':>8} {'rollout s':>10} {'inference s':>12}")
    for name, t in times.items():
        print(f"{name:10} {t['step_s']:8.3f} {t['rollout_s']:10.3f} {t['inference_s']:12.3f}")
    if pairs:
        for name, p in pairs.items():
            first = p["first_differing_step"]
            print(f"twins, {name}: {p['differing_values']} metric values differ (first at step {first}); "
                  f"micro-batch sizes differed at {p['size_changes']} steps")  # fmt: skip
    rows, ok = check_ratios(ratios, REQUIRED)
    for row in rows:
        print("  ".join(row))
    write_json(args.json, {"ratios": ratios, "steps": args.steps, "times": times, "twins": pairs})
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
