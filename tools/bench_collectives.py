#!/usr/bin/env python
"""Collectives benchmark: the data plane's broadcast / all_to_all / gather over member sets,
against MPI's own collectives on a communicator of the same ranks, in the same run.

    python tools/bench_collectives.py [--json PATH] [--repeats N] [--ranks 8]

Outside an MPI job it starts its own ranks (default 8) with the venv's mpiexec. Broadcast of a
64 MB float32 state from rank 0 to N = 1, 2, 4, 7 ranks (ours: binomial tree of P2P
transfers, receivers allocate; MPI: ``Bcast`` into a buffer allocated per call, the same
work). all_to_all and gather over all ranks of an object per pair holding a 4 MB tensor, a
small tensor and metadata (MPI: ``Alltoallv`` / ``Gatherv`` of the tensor bytes, fresh
buffers). Median of ``--repeats``. On a 2-core box 8 ranks oversubscribe the CPU: the ratios
compare like with like, the absolute times are not what a cluster sees.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchlib import check_ratios, write_json

REQUIRED = {  # ratio name -> (comparison, bound)
    "bcast64mb_vs_mpi": (">=", 0.8),
    "alltoall_vs_mpi": (">=", 0.8),
    "gather_vs_mpi": (">=", 0.8),
}
#: Measured and reported, but not met yet (see BENCHMARKS.md): they do not fail the run.
NOT_YET_MET: set[str] = set()
MB = 1 << 20


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="write {'ratios': ..., 'raw': ...} here")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--ranks", type=int, default=8)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rlinf_hpc.cli.launch import relaunch_script_if_needed

    relaunch_script_if_needed(args.ranks)
    import numpy as np
    import torch
    from mpi4py import MPI

    from rlinf_hpc.comm import DataPlane, Directory

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD.Dup()
    rank, size = world.Get_rank(), world.Get_size()
    plane = DataPlane(Directory(world_size=size))

    def timed(members: list[int], fn: Callable[[], None]) -> float:
        times = []
        for i in range(args.repeats + 1):
            world.Barrier()
            start = time.perf_counter()
            if rank in members:
                fn()
            world.Barrier()
            if i:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    raw: dict[str, float] = {}
    state = torch.randn(64 * MB // 4)
    source = state.numpy().view(np.uint8)
    for n in [k for k in (1, 2, 4, 7) if k < size]:
        members = list(range(n + 1))
        group = world.Create_group(world.Get_group().Incl(members)) if rank in members else None

        def mpi_bcast(group: MPI.Comm = group) -> None:
            group.Bcast(source if rank == 0 else np.empty(64 * MB, dtype=np.uint8), root=0)

        raw[f"bcast64mb_n{n}_mpi_s"] = timed(members, mpi_bcast)
        raw[f"bcast64mb_n{n}_ours_s"] = timed(
            members, lambda m=members: plane.broadcast(state if rank == 0 else None, 0, m)
        )
        if group is not None:
            group.Free()

    everyone = list(range(size))
    piece = 4 * MB
    objs = [
        {"x": torch.randn(piece // 4), "ids": torch.arange(16), "meta": {"src": rank, "dst": j}}
        for j in range(size)
    ]
    flat = np.concatenate([o["x"].numpy().view(np.uint8) for o in objs])
    counts = [piece] * size
    displs = [piece * j for j in range(size)]

    def mpi_alltoall() -> None:
        out = np.empty(piece * size, dtype=np.uint8)
        world.Alltoallv([flat, counts, displs, MPI.BYTE], [out, counts, displs, MPI.BYTE])

    raw["alltoall_mpi_s"] = timed(everyone, mpi_alltoall)
    raw["alltoall_ours_s"] = timed(everyone, lambda: plane.all_to_all(objs, everyone))

    mine = objs[0]["x"].numpy().view(np.uint8)

    def mpi_gather() -> None:
        out = np.empty(piece * size, dtype=np.uint8) if rank == 0 else None
        world.Gatherv(mine, [out, counts, displs, MPI.BYTE] if rank == 0 else None, root=0)

    raw["gather_mpi_s"] = timed(everyone, mpi_gather)
    raw["gather_ours_s"] = timed(everyone, lambda: plane.gather(objs[0], 0, everyone))
    if rank != 0:
        return 0
    largest = max(k for k in (1, 2, 4, 7) if k < size)
    ratios = {
        "bcast64mb_vs_mpi": raw[f"bcast64mb_n{largest}_mpi_s"] / raw[f"bcast64mb_n{largest}_ours_s"],
        "alltoall_vs_mpi": raw["alltoall_mpi_s"] / raw["alltoall_ours_s"],
        "gather_vs_mpi": raw["gather_mpi_s"] / raw["gather_ours_s"],
    }
    return report({"ratios": ratios, "raw": raw}, args, size)


def report(result: dict, args: argparse.Namespace, size: int) -> int:
    from rlinf_hpc.runtime.console import print_table

    rows, ok = check_ratios(result["ratios"], REQUIRED, NOT_YET_MET)
    print(f"bench_collectives: {size} ranks, {args.repeats} repeats (median); ratio = MPI time / ours")
    print_table("ratios (higher is better)", ["ratio", "value", "required", "status"], rows)
    scaling = []
    for n in (1, 2, 4, 7):
        if f"bcast64mb_n{n}_mpi_s" in result["raw"]:
            mpi_s, ours_s = result["raw"][f"bcast64mb_n{n}_mpi_s"], result["raw"][f"bcast64mb_n{n}_ours_s"]
            scaling.append((str(n), f"{mpi_s * 1e3:.0f}", f"{ours_s * 1e3:.0f}", f"{mpi_s / ours_s:.2f}"))
    print_table("broadcast of 64 MB to N ranks", ["N", "MPI Bcast ms", "ours ms", "ratio"], scaling)
    others = [(k, f"{v * 1e3:.1f}") for k, v in result["raw"].items() if not k.startswith("bcast")]
    print_table(f"all_to_all / gather over {size} ranks (4 MB per pair)", ["measure", "ms"], others)
    write_json(args.json, result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
