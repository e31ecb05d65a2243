#!/usr/bin/env python
"""Communication benchmark: rlinf_hpc's data plane against raw mpi4py buffers, mpi4py pickle
and torch.distributed gloo, all measured in the same run between the same two ranks.

    python tools/bench_comm.py [--json PATH] [--repeats N]

Outside an MPI job it starts its own 2 ranks with the venv's mpiexec. Every figure is the
median of ``--repeats`` timed repetitions after warm-up; throughput cases time one transfer
plus a 1-byte acknowledgement from the receiver, latency is half a round trip. The scan
sends objects of 1 to 10,000 float32 tensors totalling 1 KB to 256 MB against mpi4py pickle;
`small_leaves_min_vs_pickle` is its worst cell.
"""

from __future__ import annotations

import argparse
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchlib import check_ratios, write_json

REQUIRED = {  # ratio name -> (comparison, bound)
    "tensor64mb_vs_mpi_buffers": (">=", 0.90),
    "tensor64mb_vs_gloo": (">=", 1.2),
    "dict10x6mb_vs_pickle": (">=", 3.0),
    "dict10x6mb_vs_mpi_buffers": (">=", 0.85),
    "latency1kb_vs_pickle": ("<=", 3.0),
    "async1kb_vs_pickle_loop": (">=", 2.0),
    "alloc64mb_vs_mpi_fresh": (">=", 0.90),
    "alloc64mb_vs_mpi_buffers": (">=", 0.50),
    "latency1kb_vs_mpi": ("<=", 5.0),
    "small_leaves_min_vs_pickle": (">=", 1.0),
}
#: Ratios measured and reported, with a bound the data plane does not meet yet (see
#: BENCHMARKS.md); they do not fail the run.
NOT_YET_MET: set[str] = set()
#: Leaf counts and total sizes of the scan (objects of K equal float32 tensors).
SCAN_LEAVES = [1, 10, 100, 1000, 10_000]
SCAN_BYTES = [1 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20]


def _relaunch_if_needed() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rlinf_hpc.cli.launch import relaunch_script_if_needed

    relaunch_script_if_needed(2)


class Bench:
    def __init__(self, repeats: int) -> None:
        import torch
        from mpi4py import MPI

        from rlinf_hpc.comm import DataPlane, Directory

        torch.set_num_threads(1)
        self.torch = torch
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup()
        self.rank = self.comm.Get_rank()
        if self.comm.Get_size() != 2:
            raise SystemExit("bench_comm.py needs exactly 2 ranks")
        self.peer = 1 - self.rank
        self.plane = DataPlane(Directory(world_size=2))
        self.repeats = repeats
        self._ack = bytearray(1)

    def ack(self) -> None:
        if self.rank == 0:
            self.comm.Recv([self._ack, self.MPI.BYTE], 1, 99)
        else:
            self.comm.Send([self._ack, self.MPI.BYTE], 0, 99)

    def one_way(self, send: Callable[[], None], recv: Callable[[], None], warmup: int = 2) -> float:
        """Median seconds for rank 0 -> rank 1 (send until the receiver has it all)."""
        times = []
        for i in range(warmup + self.repeats):
            self.comm.Barrier()
            start = time.perf_counter()
            if self.rank == 0:
                send()
            else:
                recv()
            self.ack()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    def round_trip(self, send: Callable[[], None], recv: Callable[[], None], count: int) -> float:
        """Median one-way latency: half of a round trip, averaged over ``count`` trips."""
        samples = []
        for i in range(2 + self.repeats):
            self.comm.Barrier()
            start = time.perf_counter()
            for _ in range(count):
                if self.rank == 0:
                    send()
                    recv()
                else:
                    recv()
                    send()
            if i >= 2:
                samples.append((time.perf_counter() - start) / count / 2)
        return statistics.median(samples)

    def gloo(self) -> object:
        import torch.distributed as dist

        if self.rank == 0:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
        else:
            port = None
        port = self.comm.bcast(port, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=self.rank, world_size=2)
        return dist


def bench_tensor(bench: Bench, dist: object) -> dict[str, float]:
    """One 64 MB float32 tensor: raw Send/Recv, gloo, ours into out=, ours allocating."""
    torch, comm, plane = bench.torch, bench.comm, bench.plane
    size = 64 * 2**20
    tensor = torch.randn(size // 4)
    buffer = torch.empty_like(tensor)
    array, array_buffer = tensor.numpy(), buffer.numpy()
    t_raw = bench.one_way(lambda: comm.Send(array, 1, 1), lambda: comm.Recv(array_buffer, 0, 1))
    import numpy as np

    t_fresh = bench.one_way(  # what an allocating receive must do too: a new buffer each time
        lambda: comm.Send(array, 1, 1), lambda: comm.Recv(np.empty(size, dtype=np.uint8), 0, 1)
    )
    t_gloo = bench.one_way(lambda: dist.send(tensor, 1), lambda: dist.recv(buffer, 0))
    t_ours = bench.one_way(lambda: plane.send(tensor, 1), lambda: plane.recv(0, out=buffer))
    t_alloc = bench.one_way(lambda: plane.send(tensor, 1), lambda: plane.recv(0))
    return {
        "tensor64mb_mpi_buffers_GBps": size / t_raw / 1e9,
        "tensor64mb_mpi_fresh_GBps": size / t_fresh / 1e9,
        "tensor64mb_gloo_GBps": size / t_gloo / 1e9,
        "tensor64mb_ours_GBps": size / t_ours / 1e9,
        "tensor64mb_ours_alloc_GBps": size / t_alloc / 1e9,
    }


def bench_dict(bench: Bench) -> dict[str, float]:
    """A dict of 10 x 6 MB float32 tensors: raw buffers, pickle, ours into out=, ours allocating."""
    torch, comm, plane = bench.torch, bench.comm, bench.plane
    parts = {f"t{i}": torch.randn(6 * 2**20 // 4) for i in range(10)}
    part_buffers = {k: torch.empty_like(v) for k, v in parts.items()}
    total = 10 * 6 * 2**20

    def raw_send() -> None:
        for value in parts.values():
            comm.Send(value.numpy(), 1, 2)

    def raw_recv() -> None:
        for value in part_buffers.values():
            comm.Recv(value.numpy(), 0, 2)

    t_raw = bench.one_way(raw_send, raw_recv)
    t_pickle = bench.one_way(lambda: comm.send(parts, 1, 3), lambda: comm.recv(None, 0, 3))
    t_ours = bench.one_way(lambda: plane.send(parts, 1), lambda: plane.recv(0, out=part_buffers))
    t_alloc = bench.one_way(lambda: plane.send(parts, 1), lambda: plane.recv(0))
    return {
        "dict10x6mb_mpi_buffers_GBps": total / t_raw / 1e9,
        "dict10x6mb_pickle_GBps": total / t_pickle / 1e9,
        "dict10x6mb_ours_GBps": total / t_ours / 1e9,
        "dict10x6mb_ours_alloc_GBps": total / t_alloc / 1e9,
    }


def bench_small(bench: Bench) -> dict[str, float]:
    """1 KB tensors: one-way latency, and 10,000 async sends against a pickled-send loop."""
    torch, comm, plane, peer = bench.torch, bench.comm, bench.plane, bench.peer
    small = torch.randn(256)
    small_buffer = torch.empty_like(small)
    l_raw = bench.round_trip(
        lambda: comm.Send(small.numpy(), peer, 4), lambda: comm.Recv(small_buffer.numpy(), peer, 4), 500
    )
    l_pickle = bench.round_trip(lambda: comm.send(small, peer, 5), lambda: comm.recv(None, peer, 5), 300)
    l_ours = bench.round_trip(lambda: plane.send(small, peer), lambda: plane.recv(peer), 500)
    count = 10_000

    def async_send() -> None:
        handles = [plane.isend(small, 1) for _ in range(count)]
        for handle in handles:
            handle.wait()

    def async_recv() -> None:
        for _ in range(count):
            plane.recv(0)

    def pickle_send() -> None:
        for _ in range(count):
            comm.send(small, 1, 6)

    def pickle_recv() -> None:
        for _ in range(count):
            comm.recv(None, 0, 6)

    t_async = bench.one_way(async_send, async_recv, warmup=1)
    t_loop = bench.one_way(pickle_send, pickle_recv, warmup=1)
    return {
        "latency1kb_mpi_buffers_us": l_raw * 1e6,
        "latency1kb_pickle_us": l_pickle * 1e6,
        "latency1kb_ours_us": l_ours * 1e6,
        "async1kb_ours_msgs_per_s": count / t_async,
        "async1kb_pickle_loop_msgs_per_s": count / t_loop,
    }


def bench_scan(bench: Bench, sizes: list[int], leaf_counts: list[int]) -> dict[str, float]:
    """Objects of K equal float32 tensors and a given total size: ours (allocating) against
    mpi4py pickle, GB/s for every (K, size) with at least one element per leaf."""
    torch, comm, plane = bench.torch, bench.comm, bench.plane
    figures: dict[str, float] = {}
    for nbytes in sizes:
        for count in leaf_counts:
            numel = nbytes // 4 // count
            if numel < 1:
                continue
            obj = [torch.randn(numel) for _ in range(count)]
            total = 4 * numel * count
            repeats, bench.repeats = bench.repeats, max(3, min(bench.repeats, (64 << 20) // total))
            t_pickle = bench.one_way(
                lambda o=obj: comm.send(o, 1, 7), lambda: comm.recv(None, 0, 7), warmup=1
            )
            t_ours = bench.one_way(lambda o=obj: plane.send(o, 1), lambda: plane.recv(0), warmup=1)
            bench.repeats = repeats
            figures[f"scan_{count}x_{nbytes}B_ours_GBps"] = total / t_ours / 1e9
            figures[f"scan_{count}x_{nbytes}B_pickle_GBps"] = total / t_pickle / 1e9
    return figures


def scan_ratios(raw: dict[str, float]) -> dict[str, float]:
    return {
        key.removesuffix("_ours_GBps"): raw[key] / raw[key.replace("_ours_", "_pickle_")]
        for key in raw
        if key.startswith("scan_") and key.endswith("_ours_GBps")
    }


def run(bench: Bench, scan_sizes: list[int]) -> dict[str, dict[str, float]]:
    dist = bench.gloo()
    raw = bench_tensor(bench, dist) | bench_dict(bench) | bench_small(bench)
    raw |= bench_scan(bench, scan_sizes, SCAN_LEAVES)
    dist.destroy_process_group()
    scan = scan_ratios(raw)
    ratios = {
        "tensor64mb_vs_mpi_buffers": raw["tensor64mb_ours_GBps"] / raw["tensor64mb_mpi_buffers_GBps"],
        "tensor64mb_vs_gloo": raw["tensor64mb_ours_GBps"] / raw["tensor64mb_gloo_GBps"],
        "dict10x6mb_vs_pickle": raw["dict10x6mb_ours_alloc_GBps"] / raw["dict10x6mb_pickle_GBps"],
        "dict10x6mb_vs_mpi_buffers": raw["dict10x6mb_ours_GBps"] / raw["dict10x6mb_mpi_buffers_GBps"],
        "latency1kb_vs_pickle": raw["latency1kb_ours_us"] / raw["latency1kb_pickle_us"],
        "async1kb_vs_pickle_loop": raw["async1kb_ours_msgs_per_s"] / raw["async1kb_pickle_loop_msgs_per_s"],
        "alloc64mb_vs_mpi_fresh": raw["tensor64mb_ours_alloc_GBps"] / raw["tensor64mb_mpi_fresh_GBps"],
        "alloc64mb_vs_mpi_buffers": raw["tensor64mb_ours_alloc_GBps"] / raw["tensor64mb_mpi_buffers_GBps"],
        "latency1kb_vs_mpi": raw["latency1kb_ours_us"] / raw["latency1kb_mpi_buffers_us"],
        "small_leaves_min_vs_pickle": min(scan.values()),
    }
    return {"ratios": ratios, "raw": raw, "scan_vs_pickle": scan}


def report(result: dict[str, dict[str, float]], args: argparse.Namespace) -> bool:
    import torch

    from rlinf_hpc.comm import library_version
    from rlinf_hpc.runtime.console import print_table

    rows, ok = check_ratios(result["ratios"], REQUIRED, NOT_YET_MET)
    print(
        f"bench_comm: 2 ranks on {socket.gethostname()}, {library_version()}, torch "
        f"{torch.__version__}, Python {platform.python_version()}, {args.repeats} repeats (median)"
    )
    print_table("ratios (ours / baseline)", ["ratio", "value", "required", "status"], rows)
    raw = {k: v for k, v in result["raw"].items() if not k.startswith("scan_")}
    print_table("raw figures", ["measure", "value"], [(k, f"{v:,.2f}") for k, v in raw.items()])
    scan_rows = []
    for count in SCAN_LEAVES:
        cells = []
        for nbytes in args.scan_sizes:
            key = f"scan_{count}x_{nbytes}B"
            ours = result["raw"].get(f"{key}_ours_GBps")
            cells.append("-" if ours is None else f"{ours:.2f} ({result['scan_vs_pickle'][key]:.1f}x)")
        scan_rows.append((str(count), *cells))
    headers = ["leaves", *(_size_text(n) for n in args.scan_sizes)]
    print_table("scan: ours GB/s (x pickle), objects of K float32 tensors", headers, scan_rows)
    write_json(args.json, result)
    return ok


def _size_text(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="write {'ratios': ..., 'raw': ...} here")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--scan-sizes", type=int, nargs="+", default=SCAN_BYTES, help="total object sizes (bytes) of the scan"
    )
    args = parser.parse_args()
    _relaunch_if_needed()
    bench = Bench(args.repeats)
    result = run(bench, args.scan_sizes)
    if bench.rank == 0:
        return 0 if report(result, args) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
