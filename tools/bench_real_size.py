#!/usr/bin/env python
"""Real-size benchmark: a Qwen2.5 shape's weight sync, checkpoint, actor memory, FSDP2 state
and context switch, each against the baseline a user would pick, measured in the same run.

    python tools/bench_real_size.py --shape qwen2.5-0.5b [--model-dir DIR] [--json PATH]

The model directory is built with tools/make_model_dir.py when missing (random weights: sizes
and times are those of the real model). Everything runs in fp32 on CPU ranks (one thread per
rank), as configs/math_grpo_qwen2.5_0.5b_cpu.toml does.

- ``sync_vs_mpi_bcast``: one weight sync (`send_weights` -> rollout + inference ranks, 3 MPI
  ranks) against ``MPI.Bcast`` of one contiguous buffer of the same bytes to the same ranks.
- ``ckpt_save_vs_baseline`` / ``ckpt_async_stall_vs_sync`` / ``ckpt_load_vs_baseline``: the
  actor's full state (model + AdamW moments, fp32) through our checkpoint files against the
  faster of torch.save and safetensors (save) / of torch.load and safetensors (load).
- ``actor_peak_vs_state``: an actor rank's peak RSS during one update (`ActorWorker`'s
  micro-batched step, gradient checkpointing on) / its parameters + gradients + AdamW state, at
  two token budgets and at the smaller budget with twice the minibatch.
- ``fsdp2_state_vs_ddp``: per-rank bytes of parameters, gradients and AdamW state with 2 FSDP2
  ranks / DDP's (every rank holds them whole).
- ``switch_vs_memcpy``: a full offload and onload of the actor's weights and AdamW state, the
  slower direction against one ``copy_`` of the same bytes (as tools/bench_switch.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchlib import check_ratios, median_time, write_json

REPO = Path(__file__).resolve().parents[1]
REQUIRED = {
    "sync_vs_mpi_bcast": (">=", 0.8),
    "ckpt_save_vs_baseline": (">=", 0.8),
    "ckpt_async_stall_vs_sync": ("<=", 0.25),
    "ckpt_load_vs_baseline": (">=", 0.8),
    "actor_peak_vs_state": ("<=", 1.5),
    "fsdp2_state_vs_ddp": ("<=", 0.6),
    "switch_vs_memcpy": (">=", 0.5),
}
BIN = Path(sys.executable).parent


def model_dir(args: argparse.Namespace) -> Path:
    directory = Path(
        args.model_dir or Path.home() / ".cache" / "rlinf_hpc" / "models" / args.shape
    ).expanduser()
    if not (directory / "config.json").is_file():
        print(f"building {directory} ({args.shape})", flush=True)
        sys.path.insert(0, str(REPO / "tools"))
        from make_model_dir import make_model_dir

        make_model_dir(args.shape, directory)
    return directory


def load_model(directory: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)


def actor_state(directory: Path) -> dict[str, Any]:
    """The actor's model and AdamW moments after one step, as a flat dict of distinct tensors."""
    import torch

    model = load_model(directory)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    state: dict[str, Any] = {}
    for name, p in model.named_parameters():
        p.grad = None
        state[f"model/{name}"] = p.detach()
        moments = optimizer.state[p]
        state[f"adam/{name}/exp_avg"] = moments["exp_avg"]
        state[f"adam/{name}/exp_avg_sq"] = moments["exp_avg_sq"]
    return state


def bench_checkpoint_and_switch(directory: Path, repeats: int, where: Path) -> dict[str, float]:
    sys.path.insert(0, str(REPO / "tools"))
    from bench_checkpoint import bench_files

    from rlinf_hpc.scheduler.offload import OffloadOptions, StateOffloader

    state = actor_state(directory)
    raw = {f"ckpt_{k}": v for k, v in bench_files(state, repeats, where).items()}
    import torch

    copies = {k: torch.empty_like(v) for k, v in state.items()}

    def memcpy() -> None:
        for name, tensor in state.items():
            copies[name].copy_(tensor)

    raw["switch_memcpy_s"] = median_time(memcpy, repeats)
    copies.clear()
    offloader = StateOffloader(OffloadOptions(mode="none"))
    times: dict[str, list[float]] = {"offload": [], "onload": []}
    for repeat in range(repeats + 1):
        started = time.perf_counter()
        snapshot = offloader.offload(state)
        middle = time.perf_counter()
        offloader.onload(snapshot, out=state)
        if repeat:  # the first round allocates the pooled host buffers
            times["offload"].append(middle - started)
            times["onload"].append(time.perf_counter() - middle)
    for direction, values in times.items():
        raw[f"switch_{direction}_s"] = sorted(values)[len(values) // 2]
    del snapshot, offloader
    raw["switch_bytes"] = sum(t.numel() * t.element_size() for t in state.values())
    return raw


def _peak_rss_during(action: Any) -> tuple[float, float]:
    """(peak RSS bytes while ``action`` ran, sampled every 10 ms, RSS before it)."""
    import psutil

    process = psutil.Process()
    before = process.memory_info().rss
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            peak[0] = max(peak[0], process.memory_info().rss)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        action()
    finally:
        done.set()
        thread.join()
    return max(peak[0], process.memory_info().rss), before


def actor_peak(directory: Path, budget: int, samples: int, prompt: int, response: int) -> dict[str, float]:
    """One micro-batched update of ``samples`` sequences on one actor rank (the job's own
    `ActorWorker._minibatch_step`), gradient checkpointing on: peak RSS and the state bytes."""
    from types import SimpleNamespace

    import torch

    from rlinf_hpc.algorithms import DataParallelScale
    from rlinf_hpc.apps.math.actor import ActorWorker
    from rlinf_hpc.apps.math.config import GRPOConfig
    from rlinf_hpc.engines.training import Trainer

    model = load_model(directory)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    grpo = GRPOConfig(micro_batch_tokens=budget, max_response_length=response, group_size=4)
    actor = ActorWorker.__new__(ActorWorker)
    actor.config = SimpleNamespace(grpo=grpo)
    actor.tokenizer = SimpleNamespace(pad_id=151643)
    actor.device = "cpu"
    actor.trainer = Trainer(model, "cpu", lr=1e-6, clip_norm=1.0)
    generator = torch.Generator().manual_seed(0)
    chunk = []
    for i in range(samples):
        ids = torch.randint(0, 151000, (prompt + response,), generator=generator).tolist()
        chunk.append(
            {"prompt": ids[:prompt], "ids": ids[prompt:], "old": -torch.rand(response), "uid": i // 4}
        )
    advantages = torch.randn(samples, response, generator=generator)
    dp = DataParallelScale(float(samples * response), float(samples), 1)

    def update() -> None:
        actor._minibatch_step(chunk, advantages, dp, None, 0)

    update()  # AdamW's moments exist from here on: the steady state
    started = time.perf_counter()
    peak, before = _peak_rss_during(update)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "peak_rss": peak,
        "rss_before": before,
        "state_bytes": 4 * params,
        "update_s": time.perf_counter() - started,
    }


def fsdp2_state(directory: str, world: int, rank: int, store: str, out: str) -> None:
    """One rank of a ``world``-rank FSDP2 actor after one AdamW step: the bytes it holds."""
    import torch
    import torch.distributed as dist

    from rlinf_hpc.engines.training import shard_model

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model = load_model(Path(directory))
    shard_model(model, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, 151000, (1, 16))
    model(input_ids=ids).logits.float().mean().backward()
    optimizer.step()

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    held = sum(local(p) + (local(p.grad) if p.grad is not None else 0) for p in model.parameters())
    held += sum(
        local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
    )
    full = sum(p.numel() * p.element_size() for p in model.parameters())  # DTensor numel: global
    if rank == 0:
        Path(out).write_text(json.dumps({"fsdp2_bytes": held, "ddp_bytes": 4 * full}))
    dist.destroy_process_group()


def bench_fsdp2(directory: Path, where: Path) -> dict[str, float]:
    out, store = where / "fsdp2.json", where / "store"
    command = [sys.executable, __file__, "--fsdp2-rank", str(directory), str(store), str(out)]
    procs = [
        subprocess.Popen([*command, str(rank)], env={**os.environ, "OMP_NUM_THREADS": "1"})
        for rank in range(2)
    ]
    if any(p.wait(timeout=1200) for p in procs):
        raise SystemExit("the FSDP2 state measurement failed")
    return json.loads(out.read_text())


SYNC_PROGRAM = """
import sys, time, numpy as np, torch
from mpi4py import MPI
sys.path.insert(0, {repo!r})
from rlinf_hpc.comm import DataPlane, Directory
from rlinf_hpc.workers.weights import receive_weights, send_weights
from transformers import AutoModelForCausalLM
from transformers.utils import logging
logging.disable_progress_bar(); torch.set_num_threads(1)
comm = MPI.COMM_WORLD.Dup(); rank = comm.Get_rank()
plane = DataPlane(Directory(world_size=comm.Get_size()))
model = AutoModelForCausalLM.from_pretrained({model!r}, dtype=torch.float32)
nbytes = sum(p.numel() * p.element_size() for p in dict(model.named_parameters()).values())
buffer = np.ones(nbytes, dtype=np.uint8)
def sync():
    if rank == 0: send_weights(plane, model, [(1, "rollout"), (2, "inference")])
    else: receive_weights(plane, model, 0, "rollout" if rank == 1 else "inference")
def bcast(): comm.Bcast([buffer, MPI.BYTE], root=0)
times = {{"sync": [], "bcast": []}}
for repeat in range({repeats} + 1):
    for name, action in (("sync", sync), ("bcast", bcast)):
        comm.Barrier(); started = time.perf_counter(); action(); comm.Barrier()
        if repeat: times[name].append(time.perf_counter() - started)
if rank == 0:
    print("SYNC", {{k: sorted(v)[len(v) // 2] for k, v in times.items()}} | {{"bytes": nbytes}}, flush=True)
"""


def bench_sync(directory: Path, repeats: int, where: Path) -> dict[str, float]:
    program = where / "sync.py"
    program.write_text(SYNC_PROGRAM.format(repo=str(REPO), model=str(directory), repeats=repeats))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "UCX_TLS": os.environ.get("UCX_TLS", "self,sm")}
    result = subprocess.run(
        [str(BIN / "mpiexec"), "-n", "3", sys.executable, str(program)],
        capture_output=True, text=True, timeout=1800, env=env,
    )  # fmt: skip
    lines = [line for line in result.stdout.splitlines() if line.startswith("SYNC ")]
    if result.returncode or not lines:
        raise SystemExit(f"the sync measurement failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    import ast

    found = ast.literal_eval(lines[0][5:])
    return {"sync_s": found["sync"], "sync_bcast_s": found["bcast"], "sync_bytes": found["bytes"]}


def bench_actor(directory: Path, args: argparse.Namespace) -> dict[str, float]:
    raw: dict[str, float] = {}
    runs = [("small", args.budgets[0], args.samples), ("large", args.budgets[1], args.samples),
            ("small_x2", args.budgets[0], 2 * args.samples)]  # fmt: skip
    for label, budget, samples in runs:
        command = [sys.executable, __file__, "--actor-peak", str(directory), str(budget), str(samples),
                   str(args.prompt), str(args.response)]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, timeout=3600)
        lines = [line for line in result.stdout.splitlines() if line.startswith("PEAK ")]
        if result.returncode or not lines:
            raise SystemExit(f"the actor measurement failed:\n{result.stderr[-3000:]}")
        found = json.loads(lines[0][5:])
        raw |= {f"actor_{label}_{k}": v for k, v in found.items()}
        raw[f"actor_{label}_budget"], raw[f"actor_{label}_samples"] = budget, samples
        print(
            f"actor {label}: budget {budget}, {samples} samples: peak {found['peak_rss'] / 2**30:.2f} GiB",
            flush=True,
        )
    return raw


def ratios_of(raw: dict[str, float]) -> dict[str, float]:
    save_base = min(raw["ckpt_torch_save_s"], raw["ckpt_safetensors_save_s"])
    load_base = min(raw["ckpt_torch_load_s"], raw["ckpt_safetensors_load_s"])
    return {
        "sync_vs_mpi_bcast": raw["sync_bcast_s"] / raw["sync_s"],
        "ckpt_save_vs_baseline": save_base / raw["ckpt_ours_save_s"],
        "ckpt_async_stall_vs_sync": raw["ckpt_ours_stall_s"] / raw["ckpt_ours_save_s"],
        "ckpt_load_vs_baseline": load_base / raw["ckpt_ours_load_s"],
        "actor_peak_vs_state": raw["actor_large_peak_rss"] / raw["actor_large_state_bytes"],
        "fsdp2_state_vs_ddp": raw["fsdp2_bytes"] / raw["ddp_bytes"],
        # as tools/bench_switch.py: each direction against one memcpy of the same bytes
        "switch_vs_memcpy": raw["switch_memcpy_s"] / max(raw["switch_offload_s"], raw["switch_onload_s"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument(
        "--model-dir", help="the directory (default ~/.cache/rlinf_hpc/models/SHAPE; built if missing)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--budgets", type=int, nargs=2, default=[256, 1024], help="two grpo.micro_batch_tokens"
    )
    parser.add_argument("--samples", type=int, default=8, help="sequences in the actor's minibatch")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    parser.add_argument("--response", type=int, default=32, help="response tokens per sequence")
    parser.add_argument("--only", nargs="*", default=["sync", "ckpt", "actor", "fsdp2"])
    parser.add_argument("--dir", help="where to write checkpoints (default: a temporary directory)")
    parser.add_argument("--json", help="write {'ratios': ..., 'raw': ...} here")
    parser.add_argument("--actor-peak", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--fsdp2-rank", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    if args.actor_peak:
        directory, budget, samples, prompt, response = args.actor_peak
        found = actor_peak(Path(directory), int(budget), int(samples), int(prompt), int(response))
        print("PEAK " + json.dumps(found), flush=True)
        return 0
    if args.fsdp2_rank:
        directory, store, out, rank = args.fsdp2_rank
        fsdp2_state(directory, 2, int(rank), store, out)
        return 0
    directory = model_dir(args)
    raw: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        where = Path(tmp)
        # the sections that start processes of their own first; the checkpoint's state (model
        # and AdamW moments, ~6 GB at 0.5 B, and as much again in host buffers) last
        if "sync" in args.only:
            raw |= bench_sync(directory, args.repeats, where)
            print(f"sync: {raw['sync_s']:.2f} s, MPI.Bcast {raw['sync_bcast_s']:.2f} s", flush=True)
        if "fsdp2" in args.only:
            raw |= bench_fsdp2(directory, where)
            print(
                f"fsdp2: {raw['fsdp2_bytes'] / 2**30:.2f} GiB per rank, DDP {raw['ddp_bytes'] / 2**30:.2f}",
                flush=True,
            )
        if "actor" in args.only:
            raw |= bench_actor(directory, args)
        if "ckpt" in args.only:
            raw |= bench_checkpoint_and_switch(directory, args.repeats, where)
            print(f"checkpoint: ours {raw['ckpt_ours_save_s']:.2f} s", flush=True)
    return report(raw, args)


def report(raw: dict[str, float], args: argparse.Namespace) -> int:
    from rlinf_hpc.runtime.console import print_table

    try:
        ratios = ratios_of(raw)
    except KeyError:  # a partial run (--only): the raw figures only
        write_json(args.json, {"ratios": {}, "raw": raw})
        print(json.dumps(raw, indent=1))
        return 0
    rows, ok = check_ratios(ratios, REQUIRED, digits=3)
    print(f"bench_real_size: {args.shape}, fp32, median of {args.repeats}")
    print_table("ratios", ["ratio", "value", "required", "status"], rows)
    gib = 2**30

    def row(label: str) -> tuple[str, ...]:
        peak, state = raw[f"actor_{label}_peak_rss"], raw[f"actor_{label}_state_bytes"]
        budget, samples = int(raw[f"actor_{label}_budget"]), int(raw[f"actor_{label}_samples"])
        return (
            label,
            str(budget),
            str(samples),
            f"{peak / gib:.2f} GiB",
            f"{state / gib:.2f} GiB",
            f"{(peak - state) / gib:.2f} GiB",
        )

    print_table(
        "actor rank memory (one update, gradient checkpointing)",
        ["run", "budget", "samples", "peak RSS", "state", "peak - state"],
        [row(label) for label in ("small", "large", "small_x2")],
    )
    write_json(args.json, {"ratios": ratios, "raw": raw})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
