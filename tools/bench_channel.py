#!/usr/bin/env python
"""Channel benchmark: throughput against plain data-plane P2P, small-item rate, and load
balance across unequal consumers, all in one run.

    python tools/bench_channel.py [--json PATH] [--items N]

Outside an MPI job it starts its own 5 ranks with the venv's mpiexec: rank 0 produces, ranks
1-4 consume. Ranks not taking part in a measurement wait in a sleeping barrier.

* ``item16mb_vs_p2p``: 16 x 16 MB tensors rank 0 -> rank 1 through a channel / the same
  through the data plane, the faster of blocking send/recv in a loop and every isend/irecv
  posted at once (the receiver allocates in all three).
* ``small_items_per_s``: 1 KB tensors end to end through a channel (async puts, batched gets).
* ``imbalance_*``: 1 producer, 4 consumers whose per-item cost is 1x, 1x, 2x, 4x a unit times
  the item's weight (lognormal); busy-time imbalance (max - min) / mean over the run.
* ``imbalance_heterogeneous`` / ``makespan_heterogeneous_vs_ideal``: performance_aware with
  consumers 1x, 2x, 5x, 10x slower, Pareto-like item weights, at capacities 4, 8, 16 and 64; the
  worst imbalance and the worst makespan / ideal (total work / total speed) over them.
* ``short_*`` (raw figures, not gated): the same consumers at capacity 8, streams of ``--items``
  / 5 items right after a stream of ``--items`` on a channel of the same lineage (rates known
  from the start) and on fresh channels (rates learnt from the first acknowledgements).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from benchlib import write_json

REQUIRED = {
    "item16mb_vs_p2p": (">=", 0.80),
    "small_items_per_s": (">=", 20_000),
    "imbalance_perf_aware": ("<=", 0.10),
    "imbalance_heterogeneous": ("<=", 0.10),
    "makespan_heterogeneous_vs_ideal": ("<=", 1.10),
}
#: Heterogeneous load: consumers 1x, 2x, 5x, 10x slower than the fastest, Pareto item weights
#: (shape 2, scale 1, capped at 20), performance_aware at every capacity listed.
HETERO_FACTORS = [1.0, 2.0, 5.0, 10.0]
#: Reported against its bound but not failing the run yet (see BENCHMARKS.md).
NOT_YET_MET: set[str] = set()
HETERO_CAPACITIES = [4, 8, 16, 64]
FACTORS = [1.0, 1.0, 2.0, 4.0]
UNIT_S = 1e-3
POLICIES = {
    "round_robin": "imbalance_round_robin",
    "shortest_queue": "imbalance_shortest_queue",
    "performance_aware": "imbalance_perf_aware",
}


def _relaunch_if_needed() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rlinf_hpc.cli.launch import relaunch_script_if_needed

    relaunch_script_if_needed(5)


def sleeping_barrier(comm: object) -> None:
    """A barrier that sleeps instead of spinning (idle ranks must not steal the 2 cores)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(1e-3)


def make_plane(size: int, capacity: int) -> object:
    from rlinf_hpc.comm import ChannelSpec, DataPlane, Directory

    channels = {"pair": ChannelSpec("pair", (0,), (1,), "shortest_queue", capacity)}
    for policy in POLICIES:
        channels[policy] = ChannelSpec(policy, (0,), tuple(range(1, size)), policy, capacity)
    return DataPlane(
        Directory(groups={"consumers": list(range(1, size))}, world_size=size, channels=channels)
    )


def bench_item16mb(plane: object, comm: object, count: int) -> dict[str, float]:
    import torch

    from rlinf_hpc.channel import Channel, EndOfStream
    from rlinf_hpc.comm import wait_all

    tensor = torch.randn(4 * 2**20)
    nbytes = count * tensor.numel() * 4
    times: dict[str, list[float]] = {"p2p_sequential": [], "p2p_all_posted": [], "channel": []}
    channel = Channel(plane, "pair")
    for repeat in range(5):
        modes = list(times) if repeat % 2 else list(reversed(times))  # no order bias
        for mode in modes:
            sleeping_barrier(comm)
            start = time.perf_counter()
            if plane.rank == 0:
                if mode == "p2p_sequential":
                    for _ in range(count):
                        plane.send(tensor, 1, tag="p2p")
                elif mode == "p2p_all_posted":
                    wait_all([plane.isend(tensor, 1, tag="p2p") for _ in range(count)], 60)
                else:
                    for _ in range(count):
                        channel.put(tensor)
            elif plane.rank == 1:
                if mode == "p2p_sequential":
                    for _ in range(count):
                        plane.recv(0, tag="p2p", timeout=60)
                elif mode == "p2p_all_posted":
                    wait_all([plane.irecv(0, tag="p2p") for _ in range(count)], 60)
                else:
                    for _ in range(count):
                        channel.get(timeout=60)
            sleeping_barrier(comm)
            if repeat:
                times[mode].append(time.perf_counter() - start)
    if plane.rank == 0:
        channel.close()
    elif plane.rank == 1:
        try:
            extra = channel.get(timeout=60)
        except EndOfStream:
            extra = None
        assert extra is None, "the channel delivered more items than were put"
    rates = {mode: nbytes / statistics.median(t) / 1e9 for mode, t in times.items()}
    return {
        "item16mb_p2p_sequential_GBps": rates["p2p_sequential"],
        "item16mb_p2p_all_posted_GBps": rates["p2p_all_posted"],
        # the ratio's baseline is the faster of the two plain P2P patterns
        "item16mb_p2p_GBps": max(rates["p2p_sequential"], rates["p2p_all_posted"]),
        "item16mb_channel_GBps": rates["channel"],
    }


def bench_small_items(plane: object, comm: object, count: int) -> dict[str, float]:
    import torch

    from rlinf_hpc.channel import Channel, EndOfStream
    from rlinf_hpc.comm import ChannelSpec

    small = torch.randn(256)
    rates = []
    for repeat in range(3):
        name = f"small{repeat}"
        plane.directory.channels[name] = ChannelSpec(name, (0,), (1,), "shortest_queue", 8192)
        channel = Channel(plane, name)
        sleeping_barrier(comm)
        start = time.perf_counter()
        if plane.rank == 0:
            for _ in range(count):
                channel.put(small)
            channel.close()
        elif plane.rank == 1:
            taken = 0
            while True:
                try:
                    taken += len(channel.get_batch(max_items=512, timeout=60))
                except EndOfStream:
                    break
            assert taken == count, taken
        sleeping_barrier(comm)
        rates.append(count / (time.perf_counter() - start))
    return {"small_items_per_s": statistics.median(rates[1:])}


def run_weighted_load(channel: object, rank: int, weights: object, factors: list[float]) -> float:
    """Rank 0 puts every weight (the item says how heavy it is); consumer rank r sleeps
    weight x factors[r - 1] x UNIT_S per item. Returns this rank's busy seconds."""
    from rlinf_hpc.channel import EndOfStream

    busy = 0.0
    if rank == 0:
        for weight in weights:
            channel.put(float(weight), weight=float(weight))
        channel.close()
        return busy
    factor = factors[rank - 1]
    while True:
        try:
            weight = channel.get(timeout=120)
        except EndOfStream:
            return busy
        started = time.perf_counter()
        time.sleep(weight * factor * UNIT_S)
        busy += time.perf_counter() - started


def bench_imbalance(plane: object, comm: object, count: int) -> dict[str, float]:
    import numpy as np

    from rlinf_hpc.channel import Channel

    weights = np.random.default_rng(0).lognormal(0.0, 0.5, size=count)
    out: dict[str, float] = {}
    for policy, key in POLICIES.items():
        channel = Channel(plane, policy)
        sleeping_barrier(comm)
        busy = run_weighted_load(channel, plane.rank, weights, FACTORS)
        busy_all = comm.gather(busy, root=0)
        if plane.rank == 0:
            consumers = busy_all[1:]
            out[key] = (max(consumers) - min(consumers)) / statistics.mean(consumers)
            out[f"{key}_busy_s"] = [round(b, 3) for b in consumers]
    return out


def bench_heterogeneous(comm: object, count: int) -> dict[str, object]:
    """performance_aware under strongly unequal consumers, at several capacities."""
    import numpy as np

    from rlinf_hpc.channel import Channel
    from rlinf_hpc.comm import ChannelSpec, DataPlane, Directory

    size = comm.Get_size()
    weights = np.minimum(np.random.default_rng(1).pareto(2.0, size=count) + 1.0, 20.0)
    channels = {
        f"hetero{c}": ChannelSpec(f"hetero{c}", (0,), tuple(range(1, size)), "performance_aware", c)
        for c in HETERO_CAPACITIES
    }
    plane = DataPlane(
        Directory(groups={"consumers": list(range(1, size))}, world_size=size, channels=channels)
    )
    ideal = float(weights.sum()) * UNIT_S / sum(1.0 / f for f in HETERO_FACTORS)
    out: dict[str, object] = {}
    for capacity in HETERO_CAPACITIES:
        channel = Channel(plane, f"hetero{capacity}")
        sleeping_barrier(comm)
        start = time.perf_counter()
        busy = run_weighted_load(channel, plane.rank, weights, HETERO_FACTORS)
        sleeping_barrier(comm)
        makespan = time.perf_counter() - start
        busy_all = comm.gather(busy, root=0)
        if plane.rank == 0:
            consumers = busy_all[1:]
            out[f"hetero_cap{capacity}_imbalance"] = (max(consumers) - min(consumers)) / statistics.mean(
                consumers
            )
            out[f"hetero_cap{capacity}_makespan_vs_ideal"] = makespan / ideal
            out[f"hetero_cap{capacity}_busy_s"] = [round(b, 3) for b in consumers]
    out["hetero_ideal_s"] = ideal
    return out


def bench_short_streams(comm: object, count: int) -> dict[str, float]:
    """Short heterogeneous streams with and without consumer rates carried over (lineage)."""
    import numpy as np

    from rlinf_hpc.channel import Channel
    from rlinf_hpc.comm import ChannelSpec, DataPlane, Directory

    size = comm.Get_size()
    consumers = tuple(range(1, size))
    runs = [("learn", "short"), ("lineage", "short"), ("lineage", "short"), ("fresh", None), ("fresh", None)]
    specs = {
        f"{kind}{i}": ChannelSpec(f"{kind}{i}", (0,), consumers, "performance_aware", 8, lineage=lineage)
        for i, (kind, lineage) in enumerate(runs)
    }
    plane = DataPlane(Directory(groups={"consumers": list(consumers)}, world_size=size, channels=specs))
    rng = np.random.default_rng(2)
    long = np.minimum(rng.pareto(2.0, size=count) + 1.0, 20.0)
    short = np.minimum(rng.pareto(2.0, size=max(count // 5, 4 * len(consumers))) + 1.0, 20.0)
    ideal = float(short.sum()) * UNIT_S / sum(1.0 / f for f in HETERO_FACTORS)
    figures: dict[str, list[tuple[float, float]]] = {"lineage": [], "fresh": []}
    for name, (kind, _) in zip(specs, runs, strict=True):
        channel = Channel(plane, name)
        sleeping_barrier(comm)
        start = time.perf_counter()
        busy = run_weighted_load(channel, plane.rank, long if kind == "learn" else short, HETERO_FACTORS)
        sleeping_barrier(comm)
        makespan = time.perf_counter() - start
        busy_all = comm.gather(busy, root=0)
        if plane.rank == 0 and kind != "learn":
            ranks = busy_all[1:]
            figures[kind].append((makespan / ideal, (max(ranks) - min(ranks)) / statistics.mean(ranks)))
    out: dict[str, float] = {}
    for kind, pairs in figures.items():
        if pairs:
            out[f"short_{kind}_makespan_vs_ideal"] = statistics.mean(p[0] for p in pairs)
            out[f"short_{kind}_imbalance"] = statistics.mean(p[1] for p in pairs)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="write {'ratios': ..., 'raw': ...} here")
    parser.add_argument("--items", type=int, default=600, help="items per imbalance run")
    args = parser.parse_args()
    _relaunch_if_needed()
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 5:
        raise SystemExit("bench_channel.py needs exactly 5 ranks")
    plane = make_plane(5, capacity=8)
    raw = bench_item16mb(plane, comm, 16) | bench_small_items(plane, comm, 20_000)
    raw |= bench_imbalance(plane, comm, args.items)
    raw |= bench_heterogeneous(comm, args.items)
    raw |= bench_short_streams(comm, args.items)
    if plane.rank != 0:
        return 0
    ratios = {
        "item16mb_vs_p2p": raw["item16mb_channel_GBps"] / raw["item16mb_p2p_GBps"],
        "small_items_per_s": raw["small_items_per_s"],
        "imbalance_round_robin": raw["imbalance_round_robin"],
        "imbalance_shortest_queue": raw["imbalance_shortest_queue"],
        "imbalance_perf_aware": raw["imbalance_perf_aware"],
        "imbalance_heterogeneous": max(raw[f"hetero_cap{c}_imbalance"] for c in HETERO_CAPACITIES),
        "makespan_heterogeneous_vs_ideal": max(
            raw[f"hetero_cap{c}_makespan_vs_ideal"] for c in HETERO_CAPACITIES
        ),
    }
    ok = report(ratios, raw)
    write_json(args.json, {"ratios": ratios, "raw": raw})
    return 0 if ok else 1


def report(ratios: dict[str, float], raw: dict[str, object]) -> bool:
    from rlinf_hpc.runtime.console import print_table

    ok = True
    rows = []
    for name, value in ratios.items():
        op, bound = REQUIRED.get(name, ("", None))
        if name == "imbalance_perf_aware":
            passed = value <= 0.10 and value <= ratios["imbalance_round_robin"] / 4
            requirement = "<= 0.10 and <= RR/4"
        elif bound is None:
            passed, requirement = True, "-"
        else:
            passed = value >= bound if op == ">=" else value <= bound
            requirement = f"{op} {bound:g}"
        status = "pass" if passed else ("not met yet" if name in NOT_YET_MET else "FAIL")
        ok &= passed or name in NOT_YET_MET
        rows.append((name, f"{value:,.3f}", requirement, status))
    print_table("channel benchmark (5 ranks)", ["measure", "value", "required", "status"], rows)
    print_table("raw figures", ["measure", "value"], [(k, str(v)) for k, v in raw.items()])
    return ok


if __name__ == "__main__":
    sys.exit(main())
