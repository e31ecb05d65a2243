"""The send half of the data plane: envelopes and payloads out, small messages batched.

Every posted send goes into the `SendLedger` with every buffer it reads, whatever happens to the
handle the caller got. Small asynchronous sends to one destination are copied into a `Batch`
that leaves as one MPI message when it is full or when anyone waits; a blocking send of one tiny
tensor/array takes the cached-header path (`tiny`); large leaves are sent zero-copy in chunks,
or over a gloo/NCCL link where the routing says so. The receive half is `inbox`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rlinf_hpc.comm import wire
from rlinf_hpc.comm.directory import Directory
from rlinf_hpc.comm.handles import WorkHandle
from rlinf_hpc.comm.links import Link, Links
from rlinf_hpc.comm.mpi import mpi
from rlinf_hpc.comm.packing import Leaf, pack, unpicklable_path
from rlinf_hpc.comm.routing import HOST, INLINE, choose_route
from rlinf_hpc.comm.sending import Batch, CommOptions, SendLedger, SendRecord, size_text, staged_chunks
from rlinf_hpc.comm.tiny import TinyEncoder

#: A send whose payload is at least this large waits inside MPI once the receiver has its
#: envelope (see `Outbox._send_handle`).
BLOCKING_WAIT_BYTES = 1 << 20


class Outbox:
    """Per-rank send state over the data communicator (one per `DataPlane`)."""

    def __init__(
        self,
        comm: Any,
        envelope_tag: int,
        payload_tag: int,
        options: CommOptions,
        links: Links,
        directory: Callable[[], Directory],
        poll: Callable[[], None],
        record: Callable[[str, float, int, Any], None],
        stats: dict[str, int],
    ) -> None:
        self._comm = comm
        self.rank: int = comm.Get_rank()
        self._envelope_tag = envelope_tag
        self._payload_tag = payload_tag
        self.options = options
        self.links = links
        self._directory = directory
        #: The data plane's poll: what a send handle does between tests (take in envelopes).
        self._poll = poll
        #: The data plane's span hook for large transfers.
        self._record = record
        self.stats = stats
        self._batches: dict[int, Batch] = {}
        self._ledger = SendLedger()
        self._tiny = TinyEncoder(options.inline_below)

    def _name(self, rank: int) -> str:
        return self._directory().name_of(rank)

    def _count(self, envelopes: int = 0, payloads: int = 0, nbytes: int = 0) -> None:
        self.stats["envelopes_sent"] += envelopes
        self.stats["payload_messages_sent"] += payloads
        self.stats["bytes_sent"] += nbytes

    def tiny_envelope(self, obj: Any, tag: Any) -> bytes | None:
        """The cached-header envelope of ``obj`` if it is a tiny tensor/array, else None."""
        return None if self.options.verify else self._tiny.envelope(obj, tag)

    @property
    def batching(self) -> bool:
        """True while small messages wait in a batch."""
        return bool(self._batches)

    def keep_until_sent(self, requests: list[Any], buffers: list[Any]) -> None:
        """Keep ``buffers`` alive until MPI is done with ``requests`` (see `DataPlane`)."""
        self._ledger.add(SendRecord(list(requests), list(buffers)))

    def progress(self) -> None:
        """Flush batches and let finished sends release their buffers."""
        self.flush()
        self._ledger.reap()

    def counts(self) -> dict[str, int]:
        return {
            "batches": sum(1 for b in self._batches.values() if b.headers),
            "sends_in_flight": len(self._ledger),
        }

    def send_tiny(self, envelope: bytes, rank: int, tag: Any, timeout: float | None) -> None:
        """Send a `TinyEncoder` envelope and wait until MPI has it (see `DataPlane.send`)."""
        if self._batches:
            self._flush_batch(rank)  # earlier small messages leave first
        request = self._comm.Isend([envelope, mpi().BYTE], rank, self._envelope_tag)
        stats = self.stats
        stats["envelopes_sent"] += 1
        stats["bytes_sent"] += len(envelope)
        if request.Test():  # sent eagerly: nothing to keep
            return
        record = self._ledger.add(SendRecord([request], [envelope]))
        record.describe = lambda: f"send to {self._name(rank)} (tag {tag!r}, {len(envelope)} B)"
        self._send_handle(rank, tag, len(envelope), record).wait(timeout)

    def start(self, obj: Any, rank: int, tag: Any, coalesce: bool, synchronous: bool = False) -> WorkHandle:
        """Post the send of ``obj`` to world rank ``rank`` (see `DataPlane.isend`)."""
        description, leaves = pack(obj)
        nbytes = sum(leaf.nbytes for leaf in leaves)
        if coalesce and nbytes < self.options.coalesce_below:
            return self._queue_small(rank, tag, obj, description, leaves, nbytes)
        self._flush_batch(rank)  # earlier small messages must leave first to keep order
        if nbytes < self.options.inline_below:
            payloads = [leaf.host_bytes() for leaf in leaves]
            header = ("S", tag, description, True, 0)
            envelope = self._encode(header, payloads, obj, rank)
            post = self._comm.Issend if synchronous else self._comm.Isend
            record = SendRecord([post([envelope, mpi().BYTE], rank, self._envelope_tag)], [envelope])
            self._count(envelopes=1, nbytes=len(envelope))
        else:
            record = self._send_large(rank, tag, obj, description, leaves)
        record.describe = lambda: f"send to {self._name(rank)} (tag {tag!r}, {size_text(nbytes)})"
        self._ledger.add(record)
        return self._send_handle(rank, tag, nbytes, record)

    def _encode(self, header: Any, payloads: list[Any], obj: Any, rank: int) -> bytearray:
        try:
            return wire.encode(header, payloads, checksum=self.options.verify)
        except Exception as error:  # noqa: BLE001 - pickle raises many types
            raise self._unsendable(obj, header[1], rank, error) from error

    def _unsendable(self, obj: Any, tag: Any, rank: int, error: BaseException) -> TypeError:
        path = unpicklable_path(obj) or (f"tag {tag!r}" if unpicklable_path(tag, "tag") else "obj")
        return TypeError(
            f"cannot send to {self._name(rank)}: {path} cannot be encoded ({type(error).__name__}: "
            f"{error}); dict keys and tags must be picklable values (str, int, tuples of them, ...)"
        )

    def _send_handle(self, rank: int, tag: Any, nbytes: int, record: SendRecord) -> WorkHandle:
        started = time.time()

        def test() -> bool:
            if not record.test():
                return False
            if record.error is not None:
                error, record.error = record.error, None  # raised here: not logged by the ledger
                raise error
            self._record(f"send to rank {rank}", started, nbytes, tag)
            return True

        def finish() -> bool:
            """Once the receiver has the envelope (synchronous mode), its payload receives are
            posted: wait for the bytes inside MPI, which keeps large transfers pipelined."""
            requests = record.requests
            if len(requests) < 2 or nbytes < BLOCKING_WAIT_BYTES or not requests[0].Test():
                return False
            mpi().Request.Waitall(requests)
            return True

        return WorkHandle(
            test,
            lambda: None,
            lambda: (
                f"{self._name(self.rank)} waited for {self._name(rank)} to receive a send "
                f"(tag {tag!r}, {size_text(nbytes)})"
            ),
            self._poll,
            active_bytes=nbytes,
            finish=finish,
        )

    def _routes(self, rank: int, leaves: list[Leaf]) -> list[str]:
        dst_device = self._directory().device_of(rank)
        same_node = self._directory().same_node(self.rank, rank)
        return [
            choose_route(
                leaf.device,
                dst_device,
                same_node,
                leaf.nbytes,
                self.options.cpu_link,
                self.options.link_min_bytes,
            )
            if leaf.kind == "T"
            else HOST
            for leaf in leaves
        ]

    def _send_large(self, rank: int, tag: Any, obj: Any, description: Any, leaves: list[Leaf]) -> SendRecord:
        chunk = self.options.chunk_bytes
        routes = self._routes(rank, leaves)
        links: dict[str, Link] = {}
        setups: list[tuple] = []
        for backend in sorted(set(routes) - {HOST}):
            link, setup = self.links.outgoing(rank, backend)
            if link is None:  # the pair fell back to host earlier
                routes = [HOST if r == backend else r for r in routes]
                continue
            links[backend] = link
            if setup is not None:
                setups.append(setup)
        small = self.options.inline_below
        routes = [
            INLINE if r == HOST and leaf.nbytes < small else r for r, leaf in zip(routes, leaves, strict=True)
        ]
        tail = [leaf.host_bytes() for leaf, r in zip(leaves, routes, strict=True) if r == INLINE]
        sums = [wire.checksum(leaf.host_bytes()) for leaf in leaves] if self.options.verify else None
        envelope = self._encode(("S", tag, description, False, chunk, routes, setups, sums), tail, obj, rank)
        # Synchronous mode: the envelope's request completes once the receiver has taken it in,
        # which is when it posts its payload receives; the send handle then waits inside MPI.
        record = SendRecord([self._comm.Issend([envelope, mpi().BYTE], rank, self._envelope_tag)], [envelope])
        self._count(envelopes=1, nbytes=len(envelope))
        for backend, link in links.items():
            if link.group is None and not self.links.establish(link):  # the peer fails too
                routes = [HOST if r == backend else r for r in routes]
        # the message's number on each link it uses (the receiver counts the same way)
        numbers = {backend: link.next_message() for backend, link in links.items() if backend in routes}
        for index, (leaf, route) in enumerate(zip(leaves, routes, strict=True)):
            if route == INLINE:
                continue
            if route != HOST:
                tensor = leaf.value.detach().contiguous()
                record.buffers.append(tensor)
                record.works.append(self.links.send(links[route], tensor, numbers[route], index))
                continue
            for piece in staged_chunks(leaf, chunk):
                record.buffers.append(piece)
                record.requests.append(self._comm.Isend([piece, mpi().BYTE], rank, self._payload_tag))
                self._count(payloads=1, nbytes=len(piece))
                mpi().Request.Testall(record.requests)  # progress the sends while staging the next
        return record

    def _queue_small(
        self, rank: int, tag: Any, obj: Any, description: Any, leaves: list[Leaf], nbytes: int
    ) -> WorkHandle:
        try:  # encoded now, so that a bad message fails here and alone
            blob = wire.encode_message(tag, description)
        except Exception as error:  # noqa: BLE001 - pickle raises many types
            raise self._unsendable(obj, tag, rank, error) from error
        batch = self._batches.get(rank)
        if batch is None:
            batch = self._batches[rank] = Batch()
            batch.handle = WorkHandle(  # one handle for every message of the batch
                batch.complete,
                lambda: None,
                lambda: (
                    f"{self._name(self.rank)} waited for {self._name(rank)} to receive a batch "
                    f"of {len(batch.headers)} small sends"
                ),
                lambda: None if batch.sent() else self._flush_batch(rank),
            )
        batch.headers.append(blob)
        self.stats["messages_coalesced"] += 1
        for leaf in leaves:
            batch.payloads.append(bytes(leaf.host_bytes()))  # copied: the caller may reuse it
        batch.nbytes += nbytes
        if batch.nbytes >= self.options.batch_bytes or len(batch.headers) >= self.options.batch_count:
            self._flush_batch(rank)
        return batch.handle

    def _flush_batch(self, rank: int) -> None:
        batch = self._batches.pop(rank, None)
        if batch is None or not batch.headers:
            return
        envelope = wire.encode(("M", batch.headers), batch.payloads, checksum=self.options.verify)
        batch.payloads = []
        request = self._comm.Isend([envelope, mpi().BYTE], rank, self._envelope_tag)
        # The ledger, not the batch, owns the envelope: callers often drop batch handles.
        batch.record = self._ledger.add(SendRecord([request], [envelope]))
        count = len(batch.headers)
        batch.record.describe = lambda: f"batch of {count} small sends to {self._name(rank)}"
        self._count(envelopes=1, nbytes=len(envelope))

    def flush(self) -> None:
        """Send every pending batch of small messages now."""
        for rank in list(self._batches):
            self._flush_batch(rank)
