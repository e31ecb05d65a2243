#!/usr/bin/env python
"""Checkpoint benchmark: save/load time and size of our checkpoint files against a plain
`torch.save` / safetensors write of the same tensors to the same disk, in the same run; the
training stall of an async save; the cost of periodic checkpoints in the main job.

    python tools/bench_checkpoint.py [--mb 1024] [--repeats 3] [--main-steps 60] [--json PATH]

Synthetic state: ``--mb`` of float32 tensors (64 MB each, like a model's large matrices). Every
write is fsynced (a checkpoint that is not on disk is not one), ours and the baselines alike.
Ours (synchronous) = safetensors + JSON skeleton + fsync, hashed (sha256, for the manifest)
while written; an async save stalls training only for the copy into host buffers (reused
from the previous save) and writes that copy in the background. The baseline is the faster
of `torch.save` and `safetensors.save_file` (what a user would pick). Load: ours reads and
verifies the sha256; the baseline `torch.load(..., weights_only=True)` verifies nothing.
Main job: configs/math_grpo_tiny.toml for ``--main-steps`` steps with checkpoints at the
default interval vs ``checkpoint.enabled = false``, alternated twice (median of mean step
time); also the stalls it accounted itself.
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

from benchlib import check_ratios, median_time, write_json

REPO = Path(__file__).resolve().parents[1]
REQUIRED = {  # ratio name -> (comparison, bound)
    "save_vs_baseline": (">=", 0.8),
    "async_stall_vs_sync": ("<=", 0.25),
    "periodic_overhead": ("<=", 0.05),
}
MB = 1 << 20


def synthetic_state(mb: int) -> dict:
    """``mb`` MB of 64 MB float32 matrices, like a model's large ones."""
    import torch

    torch.manual_seed(0)
    return {f"layer{i}.weight": torch.randn(4096, 4096) for i in range(max(1, mb // 64))}


def bench_files(state: dict, repeats: int, where: Path) -> dict[str, float]:
    """Save and load times of ``state`` (a flat dict of host tensors): ours (sync, async
    stall, verified load) against torch.save / safetensors / torch.load, to ``where``."""
    import torch
    from safetensors.torch import save_file

    from rlinf_hpc.runtime.checkpoint import host_copy, host_view, read_state, write_state
    from rlinf_hpc.runtime.checkpoint.files import file_digest, fsync_path

    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    raw: dict[str, float] = {"state_bytes": nbytes}

    def torch_save() -> None:
        path = where / "baseline.pt"
        torch.save(state, path)
        fsync_path(path)

    def safetensors_save() -> None:
        path = where / "baseline.safetensors"
        save_file(state, str(path))
        fsync_path(path)

    records: list = []

    def ours() -> None:  # a synchronous save: written straight from the (host) tensors
        records[:] = write_state(where, "ours", host_view(state))

    pool: dict = {}

    # interleaved, each after os.sync(): no write pays for the dirty pages of the one before
    times: dict[str, list[float]] = {"torch_save_s": [], "safetensors_save_s": [], "ours_save_s": []}
    for _ in range(repeats):
        for key, fn in (
            ("torch_save_s", torch_save),
            ("safetensors_save_s", safetensors_save),
            ("ours_save_s", ours),
        ):
            os.sync()
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    raw |= {key: statistics.median(values) for key, values in times.items()}
    host_copy(state, pool)  # an async save's stall: the copy into the last save's buffers
    raw["ours_stall_s"] = median_time(lambda: host_copy(state, pool), repeats, warmup=False)
    pool.clear()  # its memory back before the loads
    raw["ours_bytes"] = sum(r["size"] for r in records)
    baseline = where / "baseline.pt"
    raw["torch_load_s"] = median_time(lambda: torch.load(baseline, weights_only=True), repeats, warmup=False)
    from safetensors.torch import load

    # load_file maps the file and reads nothing until used: read it whole, as a load must
    flat = where / "baseline.safetensors"
    raw["safetensors_load_s"] = median_time(lambda: load(flat.read_bytes()), repeats, warmup=False)

    def ours_load() -> None:
        for record in records:
            assert file_digest(where / record["name"]) == record["sha256"]
        read_state(where, "ours")

    raw["ours_load_s"] = median_time(ours_load, repeats, warmup=False)
    for name in ("baseline.pt", "baseline.safetensors", "ours.safetensors", "ours.json"):
        (where / name).unlink(missing_ok=True)
    return raw


def _main_job(steps: int, enabled: bool, run_dir: Path) -> dict:
    command = [
        str(Path(sys.executable).parent / "rlinf-hpc"), "run", str(REPO / "configs" / "math_grpo_tiny.toml"),
        "--run-dir", str(run_dir), "--resume", "never",
        "--set", f"grpo.steps={steps}", "--set", f"checkpoint.enabled={'true' if enabled else 'false'}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the main job failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def bench_main_job(steps: int, where: Path) -> dict[str, float]:
    means: dict[bool, list[float]] = {True: [], False: []}
    saved: list[dict] = []
    for index, enabled in enumerate((False, True, False, True)):
        summary = _main_job(steps, enabled, where / f"main-{index}")
        means[enabled].append(summary["mean_step_s"])
        if enabled:
            saved = summary["checkpoints"]
    step_total = statistics.median(means[True]) * steps
    return {
        "main_steps": steps,
        "main_mean_step_s_off": statistics.median(means[False]),
        "main_mean_step_s_on": statistics.median(means[True]),
        "main_saves": len(saved),
        "main_save_bytes": saved[-1]["bytes"] if saved else 0,
        "main_save_s": statistics.median(s["seconds"] for s in saved) if saved else 0.0,
        "main_stall_s_total": sum(s["stall_s"] for s in saved),
        "main_stall_share": sum(s["stall_s"] for s in saved) / max(step_total, 1e-9),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=int, default=1024, help="synthetic state size in MB (default 1024)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--main-steps", type=int, default=60, help="main-job steps per run (0: skip)")
    parser.add_argument("--dir", help="where to write (default: a temporary directory under /tmp)")
    parser.add_argument("--json", help="write {'ratios': ..., 'raw': ...} here")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        where = Path(tmp)
        raw = bench_files(synthetic_state(args.mb), args.repeats, where)
        if args.main_steps:
            raw |= bench_main_job(args.main_steps, where)
    baseline = min(raw["torch_save_s"], raw["safetensors_save_s"])
    ratios = {
        "save_vs_baseline": baseline / raw["ours_save_s"],
        "async_stall_vs_sync": raw["ours_stall_s"] / raw["ours_save_s"],
    }
    if args.main_steps:
        ratios["periodic_overhead"] = raw["main_mean_step_s_on"] / raw["main_mean_step_s_off"] - 1.0
    return report({"ratios": ratios, "raw": raw}, args)


def report(result: dict, args: argparse.Namespace) -> int:
    from rlinf_hpc.runtime.console import print_table

    raw = result["raw"]
    rows, ok = check_ratios(result["ratios"], REQUIRED, digits=3)
    gb = raw["state_bytes"] / 1e9
    print(f"bench_checkpoint: {gb:.2f} GB synthetic state, median of {args.repeats}; every write fsynced")
    print_table("ratios", ["ratio", "value", "required", "status"], rows)
    files = [
        ("torch.save + fsync", f"{raw['torch_save_s']:.2f}", f"{gb / raw['torch_save_s']:.2f}", "-"),
        ("safetensors + fsync", f"{raw['safetensors_save_s']:.2f}",
         f"{gb / raw['safetensors_save_s']:.2f}", "-"),
        ("ours, sync (write, fsync, sha256)", f"{raw['ours_save_s']:.2f}", f"{gb / raw['ours_save_s']:.2f}",
         f"{raw['ours_bytes'] / 1e9:.2f} GB"),
        ("ours: async stall (host copy)", f"{raw['ours_stall_s']:.2f}", "-", "-"),
        ("torch.load(weights_only)", f"{raw['torch_load_s']:.2f}", f"{gb / raw['torch_load_s']:.2f}", "-"),
        ("ours: verify sha256 + load", f"{raw['ours_load_s']:.2f}", f"{gb / raw['ours_load_s']:.2f}", "-"),
    ]  # fmt: skip
    print_table("1 GB-class state", ["what", "seconds", "GB/s", "size"], files)
    if "main_steps" in raw:
        print_table(
            f"main job, {raw['main_steps']} steps (checkpoint every 20 steps vs off)",
            ["measure", "value"],
            [
                ("mean step, checkpoints off", f"{raw['main_mean_step_s_off']:.3f} s"),
                ("mean step, checkpoints on", f"{raw['main_mean_step_s_on']:.3f} s"),
                ("saves / size", f"{raw['main_saves']} / {raw['main_save_bytes'] / 1e6:.1f} MB"),
                ("save start to commit (overlaps the next step)", f"{raw['main_save_s']:.3f} s"),
                ("training stalled (all saves)", f"{raw['main_stall_s_total']:.3f} s "
                 f"({100 * raw['main_stall_share']:.2f}% of step time)"),
            ],
        )  # fmt: skip
    write_json(args.json, result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
