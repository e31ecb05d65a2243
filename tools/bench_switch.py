#!/usr/bin/env python
"""Context-switch benchmark: offload/onload of a component's state against a plain memcpy of
the same bytes, and the compression each zstd mode achieves on fp32 and bf16 weights.

    python tools/bench_switch.py [--json PATH] [--mb 256]

One process. ``offload_onload_vs_memcpy``: the uncompressed full switch (offload to host, then
onload back into the live tensors) of a --mb MB fp32 state; its throughput is bytes / (the
slower of the two directions), divided by the throughput of ``dst.copy_(src)`` over the same
bytes into an already-touched buffer, measured in the same run. Medians of 5 after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from benchlib import median_time, write_json

REQUIRED = {"offload_onload_vs_memcpy": (">=", 0.5)}


def make_state(total_mb: int, dtype: object, parts: int = 8) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = total_mb * 2**20 // itemsize // parts
    return {f"layer{i}": (torch.randn(count, generator=g) * 0.02).to(dtype) for i in range(parts)}


def bench_switch(total_mb: int) -> dict[str, float]:
    import torch

    from rlinf_hpc.scheduler.offload import OffloadOptions, StateOffloader

    state = make_state(total_mb, torch.float32)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    copies = {k: torch.empty_like(v) for k, v in state.items()}

    def memcpy() -> None:
        for name, tensor in state.items():
            copies[name].copy_(tensor)

    offloader = StateOffloader(OffloadOptions(mode="none"))
    times = {"offload": [], "onload": []}
    for repeat in range(6):
        start = time.perf_counter()
        snapshot = offloader.offload(state)
        middle = time.perf_counter()
        offloader.onload(snapshot, out=state)
        end = time.perf_counter()
        if repeat:  # the first round allocates the pooled host buffers
            times["offload"].append(middle - start)
            times["onload"].append(end - middle)
    t_memcpy = median_time(memcpy)
    t_off, t_on = statistics.median(times["offload"]), statistics.median(times["onload"])
    return {
        "state_mb": total_mb,
        "memcpy_GBps": nbytes / t_memcpy / 1e9,
        "offload_GBps": nbytes / t_off / 1e9,
        "onload_GBps": nbytes / t_on / 1e9,
        "switch_GBps": nbytes / max(t_off, t_on) / 1e9,
    }


def bench_compression(total_mb: int) -> dict[str, float]:
    import torch

    from rlinf_hpc.scheduler.offload import OffloadOptions, StateOffloader

    raw: dict[str, float] = {}
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        state = make_state(total_mb, dtype)
        # the next snapshot: every weight nudged as by a small optimizer step
        nudged = {k: (v.float() * (1 + 1e-3) + 1e-6).to(dtype) for k, v in state.items()}
        for mode in ("plain", "byte_planes", "delta"):
            offloader = StateOffloader(OffloadOptions(mode=mode, level=1, threads=-1))
            offloader.offload(state)  # delta: the base
            start = time.perf_counter()
            snapshot = offloader.offload(nudged)
            offload_s = time.perf_counter() - start
            start = time.perf_counter()
            offloader.onload(snapshot)
            onload_s = time.perf_counter() - start
            raw[f"{mode}_{dtype_name}_ratio"] = snapshot.ratio
            raw[f"{mode}_{dtype_name}_compress_GBps"] = snapshot.raw_bytes / offload_s / 1e9
            raw[f"{mode}_{dtype_name}_decompress_GBps"] = snapshot.raw_bytes / onload_s / 1e9
    return raw


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="write {'ratios': ..., 'raw': ...} here")
    parser.add_argument("--mb", type=int, default=256, help="state size in MB")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    from rlinf_hpc.runtime.console import print_table

    torch.set_num_threads(1)
    raw = bench_switch(args.mb) | bench_compression(min(args.mb, 64))
    ratios = {"offload_onload_vs_memcpy": raw["switch_GBps"] / raw["memcpy_GBps"]}
    ok = ratios["offload_onload_vs_memcpy"] >= REQUIRED["offload_onload_vs_memcpy"][1]
    print_table(
        f"context switch ({args.mb} MB fp32 state)",
        ["ratio", "value", "required", "status"],
        [
            (
                "offload_onload_vs_memcpy",
                f"{ratios['offload_onload_vs_memcpy']:.2f}",
                ">= 0.5",
                "pass" if ok else "FAIL",
            )
        ],
    )
    print_table(
        "raw figures (compression on a 64 MB state, after a 1e-3 relative update)",
        ["measure", "value"],
        [(k, f"{v:,.3f}") for k, v in raw.items()],
    )
    write_json(args.json, {"ratios": ratios, "raw": raw})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
