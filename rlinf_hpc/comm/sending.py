"""Send-side pieces of the data plane: tunables, small-message batches, chunked staging."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rlinf_hpc.comm.handles import WorkHandle
from rlinf_hpc.comm.packing import Leaf
from rlinf_hpc.comm.routing import LINK_MIN_BYTES


@dataclass
class CommOptions:
    """Tunables of the data plane (bytes)."""

    coalesce_below: int = 1 << 20
    batch_bytes: int = 1 << 20
    batch_count: int = 4096
    inline_below: int = 64 << 10
    chunk_bytes: int = 64 << 20
    #: CPU<->CPU route for large leaves: "host" (MPI) or "gloo" (torch.distributed links).
    cpu_link: str = "host"
    #: Leaves smaller than this always take the MPI host path.
    link_min_bytes: int = LINK_MIN_BYTES
    #: How long a new NCCL/gloo link may take to set up before the pair falls back to host.
    link_timeout_s: float = 120.0


class Batch:
    """Small messages waiting to leave for one destination as a single MPI message."""

    def __init__(self) -> None:
        self.headers: list[tuple[Any, Any]] = []
        self.payloads: list[bytes] = []
        self.nbytes = 0
        self.request: Any = None
        self.envelope: bytearray | None = None
        self.handle: WorkHandle | None = None

    def sent(self) -> bool:
        return self.request is not None

    def complete(self) -> bool:
        return self.request is not None and bool(self.request.Test())


def staged_chunks(leaf: Leaf, chunk: int) -> Iterator[memoryview]:
    """The leaf's bytes in pieces of at most ``chunk``. Host leaves are sliced (no copy beyond
    a contiguous copy of a strided tensor); device tensors are copied to host piece by piece,
    so that copying the next piece overlaps sending the previous one."""
    if leaf.kind != "T" or leaf.device == "cpu":
        data = leaf.host_bytes()
        for start in range(0, len(data), chunk):
            yield data[start : start + chunk]
        return
    flat = leaf.value.detach().contiguous().reshape(-1)
    import torch

    raw = flat.view(torch.uint8) if flat.numel() else flat
    for start in range(0, leaf.nbytes, chunk):
        yield memoryview(raw[start : start + chunk].cpu().numpy())


def size_text(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MB" if nbytes >= 2**20 else f"{nbytes} B"
