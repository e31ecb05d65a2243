"""The links of a job's ranks, measured: pairwise latency and bandwidth, and an all-reduce check.

`check_links` runs on every rank of a world (collective). Pairs are measured one at a time
(the others wait, sleeping: a measurement never shares a link or a core with another one):
latency is half the round trip of an 8-byte ping-pong (median of ``latency_iters``), bandwidth
is ``size`` bytes sent ``iters`` times then acknowledged, in each direction. Then an all-reduce
of ``size`` bytes on every rank is checked for the right sum and timed; its bus bandwidth uses
nccl-tests' formula, ``busbw = algbw x 2(n-1)/n``. A link slower than half the median bandwidth,
or with more than twice the median latency (and 50 us more), is flagged ``slow``; a transfer
that does not finish within ``timeout_s`` is flagged ``failing`` and the check goes on.

Transports: ``mpi`` (host buffers through mpi4py, non-blocking and polled with back-off sleeps),
``gloo`` (torch.distributed, CPU tensors), ``nccl`` (torch.distributed, GPU tensors). The
torch ones join one world process group through `MPIStore` (no TCP port).

>>> bus_bandwidth(10e9, 4, "all_reduce")
15000000000.0
>>> same = [[None, 5.0, 5.0], [5.0, None, 5.0], [5.0, 5.0, None]]
>>> flag_links([[None, 10.0, 9.0], [10.0, None, 2.0], [9.5, 10.0, None]], same)
[{'src': 1, 'dst': 2, 'kind': 'slow', 'what': 'bandwidth', 'value': 2.0, 'median': 9.75}]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from rlinf_hpc.comm.waiting import Backoff
from rlinf_hpc.errors import CommTimeoutError

_TAG = 7_101  # pairs' messages on the world communicator (the check runs outside any job)
_SPIN_S = 0.2  # transfers in flight yield instead of sleeping: microsecond latencies stay visible


def bus_bandwidth(algbw: float, n: int, collective: str = "all_reduce") -> float:
    """nccl-tests' bus bandwidth: the per-link rate a ring needs for ``algbw`` (bytes/s)."""
    factor = 2 * (n - 1) / n if collective == "all_reduce" else (n - 1) / n
    return algbw * factor


def flag_links(
    bandwidth: list[list[float | None]], latency_us: list[list[float | None]]
) -> list[dict[str, Any]]:
    """Links slower than half the median bandwidth or over twice the median latency (+50 us)."""
    flags: list[dict[str, Any]] = []
    cells = [(i, j) for i in range(len(bandwidth)) for j in range(len(bandwidth)) if i != j]
    rates = [bandwidth[i][j] for i, j in cells if bandwidth[i][j] is not None]
    delays = [latency_us[i][j] for i, j in cells if latency_us[i][j] is not None]
    if not rates or not delays:
        return flags
    rate_median, delay_median = statistics.median(rates), statistics.median(delays)
    for i, j in cells:
        rate, delay = bandwidth[i][j], latency_us[i][j]
        if rate is not None and rate < 0.5 * rate_median:
            flags.append({"src": i, "dst": j, "kind": "slow", "what": "bandwidth", "value": rate,
                          "median": rate_median})  # fmt: skip
        if delay is not None and delay > 2 * delay_median and delay > delay_median + 50:
            flags.append({"src": i, "dst": j, "kind": "slow", "what": "latency", "value": delay,
                          "median": delay_median})  # fmt: skip
    return flags


class MpiTransport:
    """Host buffers over mpi4py, every wait polled (MPICH's blocking calls spin a core)."""

    name = "mpi"

    def __init__(self, comm: Any, timeout_s: float) -> None:
        self.comm = comm
        self.timeout_s = timeout_s

    def buffer(self, nbytes: int, fill: float = 1.0) -> Any:
        return np.full(max(nbytes // 4, 1), fill, dtype=np.float32)

    def _wait(self, request: Any, what: str) -> None:
        backoff = Backoff(initial=1e-6, maximum=1e-3, spin=_SPIN_S)
        deadline = time.monotonic() + self.timeout_s
        while not request.Test():
            if time.monotonic() > deadline:
                request.Cancel()
                raise CommTimeoutError(f"{what}: not done after {self.timeout_s:.0f} s")
            backoff.sleep()

    def send(self, buf: Any, peer: int) -> None:
        self._wait(self.comm.Isend(buf, dest=peer, tag=_TAG), f"send to rank {peer}")

    def recv(self, buf: Any, peer: int) -> None:
        self._wait(self.comm.Irecv(buf, source=peer, tag=_TAG), f"receive from rank {peer}")

    def barrier(self) -> None:
        backoff = Backoff()
        request = self.comm.Ibarrier()
        while not request.Test():
            backoff.sleep()

    def all_reduce(self, buf: Any) -> Any:
        out = np.empty_like(buf)
        from mpi4py import MPI

        self._wait(self.comm.Iallreduce(buf, out, op=MPI.SUM), "all-reduce")
        return out

    def total(self, buf: Any) -> float:
        return float(buf[0])


class TorchTransport:
    """torch.distributed (gloo on CPU tensors, NCCL on GPU tensors), one world process group."""

    def __init__(self, comm: Any, backend: str, device: str, timeout_s: float) -> None:
        import datetime

        import torch
        import torch.distributed as dist

        from rlinf_hpc.comm.store import MPIStore

        self.torch, self.dist, self.name, self.device = torch, dist, backend, device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        store = MPIStore(comm, tag=_TAG + 1, timeout_s=timeout_s)
        dist.init_process_group(
            backend, store=store, rank=comm.Get_rank(), world_size=comm.Get_size(), timeout=self.timeout
        )

    def buffer(self, nbytes: int, fill: float = 1.0) -> Any:
        return self.torch.full((max(nbytes // 4, 1),), fill, dtype=self.torch.float32, device=self.device)

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(self.timeout)
        except Exception as exc:  # noqa: BLE001 - gloo/NCCL raise their own types
            raise CommTimeoutError(f"{what}: {exc}") from exc
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()

    def send(self, buf: Any, peer: int) -> None:
        self._wait(self.dist.isend(buf, peer), f"send to rank {peer}")

    def recv(self, buf: Any, peer: int) -> None:
        self._wait(self.dist.irecv(buf, peer), f"receive from rank {peer}")

    def barrier(self) -> None:
        self.dist.barrier()

    def all_reduce(self, buf: Any) -> Any:
        out = buf.clone()
        self._wait(self.dist.all_reduce(out, async_op=True), "all-reduce")
        return out

    def total(self, buf: Any) -> float:
        return float(buf[0].item())

    def close(self) -> None:
        self.dist.destroy_process_group()


def open_transport(backend: str, timeout_s: float) -> tuple[Any, Any]:
    """The world communicator and the transport to check (``auto``: NCCL when this rank has a
    GPU, else MPI). `ValueError` when the world is one rank or NCCL has no GPU."""
    from rlinf_hpc.comm.mpi import world

    comm = world()
    if comm.Get_size() < 2:
        raise ValueError("it runs inside a job of at least 2 ranks (--np N, srun -n N, mpiexec -n N)")
    if backend in ("auto", "nccl"):
        import torch

        if torch.cuda.is_available():
            device = f"cuda:{_local_rank(comm.Get_rank()) % torch.cuda.device_count()}"
            torch.cuda.set_device(device)
            return comm, TorchTransport(comm, "nccl", device, timeout_s)
        if backend == "nccl":
            raise ValueError("--backend nccl needs a GPU on every rank; use --backend mpi or gloo")
    if backend == "gloo":
        return comm, TorchTransport(comm, "gloo", "cpu", timeout_s)
    return comm, MpiTransport(comm, timeout_s)


def _local_rank(rank: int) -> int:
    """This rank's index on its node, from the launcher (SLURM, Hydra, Open MPI)."""
    import os

    for name in ("SLURM_LOCALID", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return rank


@dataclass
class LinkReport:
    """What `check_links` found (rank 0's copy is complete; ``None`` where not measured)."""

    backend: str
    hosts: list[str]
    size_bytes: int
    latency_us: list[list[float | None]]
    bandwidth_gbs: list[list[float | None]]
    allreduce: dict[str, Any] = field(default_factory=dict)
    flags: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pair(transport: Any, me: int, peer: int, first: bool, size: int, iters: int, latency_iters: int
          ) -> tuple[float, float]:  # fmt: skip
    """Latency (us) and bandwidth me -> peer (GB/s) of one pair; ``first`` pings first."""
    small, big, ack = transport.buffer(8), transport.buffer(size), transport.buffer(4)
    rounds = []
    for _ in range(latency_iters + 1):  # the first round trip warms the path up
        started = time.perf_counter()
        if first:
            transport.send(small, peer)
            transport.recv(small, peer)
        else:
            transport.recv(small, peer)
            transport.send(small, peer)
        rounds.append(time.perf_counter() - started)
    latency = statistics.median(rounds[1:]) / 2 * 1e6
    rates = {}
    for sender in (True, False):  # first's direction, then the other one
        sending = sender == first
        started = time.perf_counter()
        for _ in range(iters):
            transport.send(big, peer) if sending else transport.recv(big, peer)
        transport.recv(ack, peer) if sending else transport.send(ack, peer)
        rates[sending] = size * iters / (time.perf_counter() - started) / 1e9
    return latency, rates[True]


def check_links(
    comm: Any,
    transport: Any,
    size: int = 16 << 20,
    iters: int = 5,
    latency_iters: int = 20,
    progress: Callable[[str], None] | None = None,
) -> LinkReport | None:
    """Every rank calls it; rank 0 gets the report, the others None."""
    import socket

    rank, n = comm.Get_rank(), comm.Get_size()
    hosts = comm.allgather(socket.gethostname())
    latency: list[list[float | None]] = [[None] * n for _ in range(n)]
    bandwidth: list[list[float | None]] = [[None] * n for _ in range(n)]
    failures: list[dict[str, Any]] = []
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    for index, (i, j) in enumerate(pairs):
        transport.barrier()
        if rank in (i, j):
            peer = j if rank == i else i
            try:
                delay, rate = _pair(transport, rank, peer, rank == i, size, iters, latency_iters)
                latency[rank][peer], bandwidth[rank][peer] = delay, rate
            except CommTimeoutError as exc:
                failures.append({"src": rank, "dst": peer, "kind": "failing", "what": str(exc)})
        if rank == 0 and progress is not None and (index + 1) % max(1, len(pairs) // 10) == 0:
            progress(f"{index + 1}/{len(pairs)} pairs measured")
    transport.barrier()
    rows = comm.gather((latency[rank], bandwidth[rank], failures), root=0)
    allreduce = _check_allreduce(transport, rank, n, size, iters)
    if rank != 0:
        return None
    for r, (lat_row, bw_row, _) in enumerate(rows):
        latency[r], bandwidth[r] = lat_row, bw_row
    all_failures = [f for _, _, fails in rows for f in fails]
    flags = flag_links(bandwidth, latency) + all_failures
    return LinkReport(transport.name, hosts, size, latency, bandwidth, allreduce, flags)


def _check_allreduce(transport: Any, rank: int, n: int, size: int, iters: int) -> dict[str, Any]:
    """An all-reduce of ``size`` bytes: the right sum, its algorithm and bus bandwidth."""
    buf = transport.buffer(size, float(rank + 1))
    expected = n * (n + 1) / 2
    try:
        out = transport.all_reduce(buf)  # warm-up, and the correctness check
        correct = abs(transport.total(out) - expected) < 1e-6 * expected
        transport.barrier()
        started = time.perf_counter()
        for _ in range(iters):
            transport.all_reduce(buf)
        seconds = (time.perf_counter() - started) / iters
    except CommTimeoutError as exc:
        return {"ok": False, "error": str(exc)}
    algbw = size / seconds
    return {"ok": correct, "seconds": seconds, "algbw_gbs": algbw / 1e9,
            "busbw_gbs": bus_bandwidth(algbw, n) / 1e9, "expected_sum": expected}  # fmt: skip
