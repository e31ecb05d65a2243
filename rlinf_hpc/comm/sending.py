"""Send-side pieces of the data plane: tunables, the ledger of posted sends, small-message
batches, chunked staging."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from rlinf_hpc.comm.handles import WorkHandle
from rlinf_hpc.comm.mpi import mpi
from rlinf_hpc.comm.packing import Leaf
from rlinf_hpc.comm.routing import LINK_MIN_BYTES

log = logging.getLogger("rlinf_hpc.comm")


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
    #: Integrity mode: every message carries a CRC32 of its header and payload bytes, checked
    #: on receipt (`CorruptMessageError` names sender, tag and size on a mismatch).
    verify: bool = False


class SendRecord:
    """The MPI requests (and link works) of one posted send, with every buffer they read.

    The data plane keeps each record until MPI is done with it, whatever happens to the
    handle the caller got: dropped unwaited, timed out, or interrupted. Freeing a buffer that
    MPI still reads is how a later message arrives torn.
    """

    __slots__ = ("buffers", "describe", "error", "requests", "works")

    def __init__(self, requests: list[Any], buffers: list[Any], works: list[Any] | None = None) -> None:
        self.requests = requests
        self.buffers = buffers
        self.works = works or []
        #: A link failure seen by `test`, until a handle raises it (then cleared).
        self.error: BaseException | None = None
        #: What the send was, for the warning about a failure nobody waited for (built only then).
        self.describe: Callable[[], str] | None = None

    def test(self) -> bool:
        """True once MPI and the links are done with every buffer (which are then released)."""
        if self.buffers is None:
            return True
        if self.requests and not mpi().Request.Testall(self.requests):
            return False
        if self.works and not all(work.is_completed() for work in self.works):
            return False
        for work in self.works:
            try:
                work.wait()  # raises if the link failed during the transfer
            except Exception as error:  # noqa: BLE001 - kept for the handle that waits on it
                self.error = error
        self.requests, self.works, self.buffers = [], [], None
        return True


class SendLedger:
    """Every send this rank posted and MPI has not finished yet (see `SendRecord`)."""

    def __init__(self) -> None:
        self._records: list[SendRecord] = []
        self._reap_at = 64

    def add(self, record: SendRecord) -> SendRecord:
        self._records.append(record)
        if len(self._records) >= self._reap_at:  # amortised: a loop of isends stays O(n)
            self.reap()
            self._reap_at = max(64, 2 * len(self._records))
        return record

    def reap(self) -> None:
        """Drop the records MPI is done with; a failed one whose handle nobody waits on is logged."""
        live = []
        for record in self._records:
            if not record.test():
                live.append(record)
            elif record.error is not None and record.describe is not None:
                log.warning("%s failed after its handle was dropped: %s", record.describe(), record.error)
                record.error = None
        self._records = live

    def __len__(self) -> int:
        return len(self._records)


class Batch:
    """Small messages waiting to leave for one destination as a single MPI message."""

    def __init__(self) -> None:
        #: Each message's pickled (tag, description), encoded when it was queued.
        self.headers: list[bytes] = []
        self.payloads: list[bytes] = []
        self.nbytes = 0
        self.record: SendRecord | None = None
        self.handle: WorkHandle | None = None

    def sent(self) -> bool:
        return self.record is not None

    def complete(self) -> bool:
        return self.record is not None and self.record.test()


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
