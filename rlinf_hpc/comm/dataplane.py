"""Point-to-point transfers of structured objects between any two ranks.

Every transfer starts with an *envelope* (see `wire`) on its own MPI tag; leaves too large to
ride inside it follow as raw payload messages, chunked, on a second tag. MPI keeps messages
between two ranks on one tag in order, so payloads always match the envelope before them.

* Small asynchronous sends (< ``coalesce_below``) to one destination are copied into a batch
  that leaves as one MPI message when it is full or when anyone waits.
* Large leaves are sent zero-copy from their own memory (after a contiguous/host staging copy
  only where needed), in chunks, testing earlier requests between chunks so that the staging
  of the next leaf overlaps the transfer of the previous one.
* Receives (see `inbox`) post their payload buffers as soon as the envelope arrives, into the
  caller's ``out=`` buffers or tensors/arrays of the final dtype and shape, so the bytes land
  where the object will live.

One DataPlane per rank, used from the rank's main thread.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

from rlinf_hpc.comm import wire
from rlinf_hpc.comm.collectives import Collectives, Members
from rlinf_hpc.comm.directory import Address, Directory
from rlinf_hpc.comm.handles import WorkHandle
from rlinf_hpc.comm.inbox import MISSING, NOTHING, Inbox
from rlinf_hpc.comm.links import Link, Links
from rlinf_hpc.comm.mpi import mpi, world
from rlinf_hpc.comm.packing import Leaf, pack, unpicklable_path
from rlinf_hpc.comm.routing import HOST, INLINE, choose_route
from rlinf_hpc.comm.sending import Batch, CommOptions, SendLedger, SendRecord, size_text, staged_chunks
from rlinf_hpc.comm.tiny import TinyEncoder
from rlinf_hpc.errors import CommTimeoutError

_ENVELOPE_TAG = 21
_PAYLOAD_TAG = 22
#: A receive whose landing payload is at least this large waits inside MPI (see
#: `Inbox.finish_landing`); smaller ones poll.
_BLOCKING_WAIT_BYTES = 1 << 20
#: An allocating `recv` polls the cheapest way (one probe of its source) this long before it
#: posts a receive with the full wait machinery: a round trip of small messages costs a few
#: microseconds, so most answers arrive inside it.
_FAST_RECV_S = 50e-6


class DataPlane:
    """send/recv/isend/irecv of nested objects holding tensors, between any two ranks.

    Addresses are world ranks or ``(component, group_rank)`` pairs resolved through the
    `Directory`. Tags are any hashable value (default 0); per (source, tag) order is kept.
    """

    def __init__(
        self,
        directory: Directory | None = None,
        device: str = "cpu",
        options: CommOptions | None = None,
        comm: Any = None,
    ) -> None:
        # Collective over ``comm`` (default COMM_WORLD); addresses are ranks of ``comm``.
        self._comm = (comm if comm is not None else world()).Dup()
        self._comm.Set_name("rlinf_hpc.data")
        self.rank: int = self._comm.Get_rank()
        self.size: int = self._comm.Get_size()
        self.directory = directory or Directory(world_size=self.size)
        self.device = device
        self.options = options or CommOptions()
        self._batches: dict[int, Batch] = {}
        self._ledger = SendLedger()
        self._directory_listeners: list[Callable[[Directory, Directory], None]] = []
        self._poll_hooks: list[weakref.WeakMethod] = []
        #: Called as hook(name, category, lane, start, end, **args) for each large transfer.
        self.span_hook: Callable[..., None] | None = None
        self.links = Links(self.rank, self.options.link_timeout_s, self._comm)
        self._tiny = TinyEncoder(self.options.inline_below)
        self._inbox = Inbox(self._comm, _ENVELOPE_TAG, _PAYLOAD_TAG, self._name, self.links, device)
        self.collectives = Collectives(self, self._comm)
        #: Counters for diagnostics and tests (monotonic over the plane's life).
        self.stats = {
            "envelopes_sent": 0,
            "payload_messages_sent": 0,
            "bytes_sent": 0,
            "messages_coalesced": 0,
        }

    def _count(self, envelopes: int = 0, payloads: int = 0, nbytes: int = 0) -> None:
        self.stats["envelopes_sent"] += envelopes
        self.stats["payload_messages_sent"] += payloads
        self.stats["bytes_sent"] += nbytes

    # -- addressing ----------------------------------------------------------------------------
    def set_directory(self, directory: Directory) -> None:
        """Adopt a new placement. Links to ranks whose place changed are released; a rank whose
        own place changed releases all of its links (every peer drops its end too)."""
        if directory.version < self.directory.version:
            return  # an older copy queued behind a newer one this rank already has
        old, self.directory = self.directory, directory
        if self.rank in directory.devices:  # tensors received here land on this device
            self.device = self._inbox.device = directory.devices[self.rank]
        changed = {
            r
            for r in range(max(old.world_size, directory.world_size))
            if old.roles_of(r) != directory.roles_of(r)
        }
        if self.rank in changed:
            changed = set(range(max(old.world_size, directory.world_size)))
        if changed:
            self.links.release(changed)
        for listener in list(self._directory_listeners):
            listener(old, directory)

    def add_directory_listener(self, listener: Callable[[Directory, Directory], None]) -> None:
        """Call ``listener(old, new)`` after every placement change (channels use this)."""
        self._directory_listeners.append(listener)

    def resolve(self, address: Address) -> int:
        """World rank of an address (see `Directory.resolve`)."""
        return self.directory.resolve(address)

    def _name(self, rank: int) -> str:
        return self.directory.name_of(rank)

    # -- sending -------------------------------------------------------------------------------
    def send(self, obj: Any, dst: Address, tag: Any = 0, timeout: float | None = None) -> None:
        """Send ``obj`` and wait until its buffers may be reused.

        Two ranks may `send` to each other at the same moment: while a send waits, this rank
        takes in the envelopes that arrive (posting their payload receives), so the peer's send
        completes and then this one does.

        If the wait times out (`CommTimeoutError`), the message is not withdrawn: it is
        delivered intact if the receiver ever takes it, and the data plane keeps every buffer
        it reads alive until MPI is done with them. Do not modify a tensor whose send timed
        out (send a copy if you must).
        """
        if not self.options.verify:
            envelope = self._tiny.envelope(obj, tag)
            if envelope is not None:  # a small tensor/array: cached header, no handle if eager
                self._send_tiny(envelope, self.resolve(dst), tag, timeout)
                return
        self._start_send(obj, dst, tag, coalesce=False).wait(timeout)

    def _send_tiny(self, envelope: bytes, rank: int, tag: Any, timeout: float | None) -> None:
        if self._batches:
            self._flush_batch(rank)  # earlier small messages leave first
        request = self._comm.Isend([envelope, mpi().BYTE], rank, _ENVELOPE_TAG)
        stats = self.stats
        stats["envelopes_sent"] += 1
        stats["bytes_sent"] += len(envelope)
        if request.Test():  # sent eagerly: nothing to keep
            return
        record = self._ledger.add(SendRecord([request], [envelope]))
        record.describe = lambda: f"send to {self._name(rank)} (tag {tag!r}, {len(envelope)} B)"
        self._send_handle(rank, tag, len(envelope), record).wait(timeout)

    def isend(self, obj: Any, dst: Address, tag: Any = 0, coalesce: bool = True) -> WorkHandle:
        """Start sending ``obj``; returns a handle. Buffers must stay unchanged until it is done
        (small coalesced messages are copied at once and are safe to change immediately).

        The handle may be dropped unwaited: the data plane keeps the message's buffers until
        MPI has sent them. An object that cannot travel raises here (TypeError naming the path
        inside it), never later when a batch leaves, so other messages are not affected.
        """
        return self._start_send(obj, dst, tag, coalesce)

    def _start_send(
        self, obj: Any, dst: Address, tag: Any, coalesce: bool, synchronous: bool = False
    ) -> WorkHandle:
        rank = self.resolve(dst)
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
            record = SendRecord([post([envelope, mpi().BYTE], rank, _ENVELOPE_TAG)], [envelope])
            self._count(envelopes=1, nbytes=len(envelope))
        else:
            record = self._send_large(rank, tag, obj, description, leaves)
        record.describe = lambda: f"send to {self._name(rank)} (tag {tag!r}, {size_text(nbytes)})"
        self._ledger.add(record)
        return self._send_handle(rank, tag, nbytes, record)

    def isend_synchronous(self, obj: Any, dst: Address, tag: Any = 0) -> WorkHandle:
        """`isend` whose handle completes only once the receiver has taken the message in (MPI
        synchronous mode), never coalesced: the collectives learn when a peer has posted the
        receive of what follows."""
        return self._start_send(obj, dst, tag, coalesce=False, synchronous=True)

    def keep_until_sent(self, requests: list[Any], buffers: list[Any]) -> None:
        """Keep ``buffers`` alive until MPI is done with ``requests`` (sends posted outside the
        data plane's own paths, e.g. the collectives' bulk bytes), whatever the caller does."""
        self._ledger.add(SendRecord(list(requests), list(buffers)))

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
            if len(requests) < 2 or nbytes < _BLOCKING_WAIT_BYTES or not requests[0].Test():
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
            self.poll,
            active_bytes=nbytes,
            finish=finish,
        )

    def poll(self) -> None:
        """Flush batches and take in every envelope sent to this rank (posting its payload
        receives). Every wait in the data plane and the channels calls this, so that a rank
        blocked on one peer never blocks a third rank's send to it: head-to-head sends and
        cycles of bounded channels (a feeder that also takes the pipeline's output) complete
        instead of deadlocking. Memory stays bounded by what the senders may have in flight
        (channel capacities). Poll hooks (`add_poll_hook`) run first."""
        if self._poll_hooks:
            hooks = [ref() for ref in self._poll_hooks]
            if any(hook is None for hook in hooks):  # their owners are gone
                self._poll_hooks = [
                    ref for ref, hook in zip(self._poll_hooks, hooks, strict=True) if hook is not None
                ]
            for hook in hooks:
                if hook is not None:
                    hook()
        self.flush()
        self._inbox.pull_any()

    def add_poll_hook(self, method: Callable[[], None]) -> None:
        """Run the bound ``method`` on every `poll` while its object lives (channels send the
        acknowledgements they owe); held weakly, so a dropped channel stops being polled."""
        self._poll_hooks.append(weakref.WeakMethod(method))

    def _routes(self, rank: int, leaves: list[Leaf]) -> list[str]:
        dst_device = self.directory.device_of(rank)
        same_node = self.directory.same_node(self.rank, rank)
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
        record = SendRecord([self._comm.Issend([envelope, mpi().BYTE], rank, _ENVELOPE_TAG)], [envelope])
        self._count(envelopes=1, nbytes=len(envelope))
        for backend, link in links.items():
            if link.group is None and not self.links.establish(link):  # the peer fails too
                routes = [HOST if r == backend else r for r in routes]
        for leaf, route in zip(leaves, routes, strict=True):
            if route == INLINE:
                continue
            if route != HOST:
                tensor = leaf.value.detach().contiguous()
                record.buffers.append(tensor)
                record.works.append(links[route].send(tensor))
                continue
            for piece in staged_chunks(leaf, chunk):
                record.buffers.append(piece)
                record.requests.append(self._comm.Isend([piece, mpi().BYTE], rank, _PAYLOAD_TAG))
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
        request = self._comm.Isend([envelope, mpi().BYTE], rank, _ENVELOPE_TAG)
        # The ledger, not the batch, owns the envelope: callers often drop batch handles.
        batch.record = self._ledger.add(SendRecord([request], [envelope]))
        count = len(batch.headers)
        batch.record.describe = lambda: f"batch of {count} small sends to {self._name(rank)}"
        self._count(envelopes=1, nbytes=len(envelope))

    def flush(self) -> None:
        """Send every pending batch of small messages now."""
        for rank in list(self._batches):
            self._flush_batch(rank)

    def progress(self) -> None:
        """Flush batches and let finished sends release their buffers (call when idle)."""
        self.flush()
        self._ledger.reap()

    # -- receiving -----------------------------------------------------------------------------
    def recv(
        self,
        src: Address,
        tag: Any = 0,
        device: str | None = None,
        timeout: float | None = None,
        out: Any = None,
    ) -> Any:
        """Receive the next object from ``src`` with ``tag``; tensors land on ``device``
        (default: this rank's device).

        ``out`` is an object shaped like the message (a tensor, or a dict/list/... of them)
        whose tensors and arrays receive the payload: posted before the message arrives, the
        bytes land in them directly with no allocation (steady-state loops, weight sync). The
        result is rebuilt from the message with ``out``'s leaves in place; ValueError if the
        message does not fit ``out`` (leaf count, dtype or shape).
        """
        if out is None:  # fast path: the message is (nearly) here and nobody queues before us
            rank = self.resolve(src)
            if self._batches:
                self.flush()
            target = device or self.device
            deadline = time.perf_counter() + _FAST_RECV_S
            while True:  # a small message a peer is sending right now arrives within microseconds
                value = self._inbox.take_tiny(rank, tag) if target == "cpu" else MISSING
                if value is not MISSING and value is not NOTHING:
                    return value
                item = None if value is NOTHING else self._inbox.take_ready(rank, tag)
                if item is not None:
                    return self._inbox.finish(item, rank, target, None)
                if time.perf_counter() > deadline:
                    break
        return self.irecv(src, tag, device, out).wait(timeout)

    def try_recv(self, src: Address, tag: Any = 0, device: str | None = None) -> tuple[bool, Any]:
        """``(True, obj)`` if a complete message from ``src`` with ``tag`` is here, else
        ``(False, None)``; never waits."""
        rank = self.resolve(src)
        item = self._inbox.take_ready(rank, tag)
        if item is None:
            return False, None
        return True, self._inbox.finish(item, rank, device or self.device, None)

    def irecv(self, src: Address, tag: Any = 0, device: str | None = None, out: Any = None) -> WorkHandle:
        """Start receiving; the handle's ``wait()`` returns the object (see `recv`)."""
        rank = self.resolve(src)
        out_leaves = None if out is None else pack(out, root="out")[1]
        waiter = self._inbox.post(rank, tag, out_leaves)
        target = device or self.device

        marked: list[bool] = []

        def test() -> bool:
            if waiter.withdrawn:
                raise CommTimeoutError(
                    f"receive from {self._name(rank)} (tag {tag!r}) timed out earlier and was "
                    "withdrawn; post a new one"
                )
            if waiter.item is None:
                self._inbox.progress(rank)
                if waiter.item is None and not marked:
                    landing = self._inbox.bytes_landing(rank, tag)
                    if landing:  # its payload is on the way: poll closely until it is in
                        handle.mark_active(landing)
                        marked.append(True)
            return waiter.item is not None

        started = time.time()

        def result() -> Any:
            assert waiter.item is not None
            self._record(f"recv from rank {rank}", started, waiter.item.nbytes, tag)
            return self._inbox.finish(waiter.item, rank, target, out_leaves)

        def finish() -> bool:
            """The payload is landing (the sender posted it with the envelope): wait in MPI."""
            if waiter.item is not None or self._inbox.bytes_landing(rank, tag) < _BLOCKING_WAIT_BYTES:
                return False
            self._inbox.finish_landing(rank, tag)
            return True

        def abandon() -> bool:
            """Timed out: withdraw the receive, so that the next message goes to the next
            receive — unless this one's message is here already and landing."""
            return waiter.item is not None or not self._inbox.withdraw(rank, tag, waiter)

        handle = WorkHandle(
            test,
            result,
            lambda: f"{self._name(self.rank)} waited for {self._name(rank)} to send (tag {tag!r})",
            self.poll,
            finish=finish,
            abandon=abandon,
        )
        handle.peer = rank
        return handle

    def _record(self, name: str, started: float, nbytes: int, tag: Any) -> None:
        """A span for a large transfer (from post to completion, waiting included)."""
        if self.span_hook is not None and nbytes >= _BLOCKING_WAIT_BYTES:
            self.span_hook(name, "transfer", "comm", started, time.time(), bytes=nbytes, tag=repr(tag))

    # -- collectives ---------------------------------------------------------------------------
    def broadcast(self, obj: Any, root: Address, members: Members, timeout: float | None = None) -> Any:
        """``root``'s object on every member; see `Collectives.broadcast`."""
        return self.collectives.broadcast(obj, root, members, timeout)

    def gather(
        self, obj: Any, root: Address, members: Members, timeout: float | None = None
    ) -> list[Any] | None:
        """Every member's object on ``root``; see `Collectives.gather`."""
        return self.collectives.gather(obj, root, members, timeout)

    def all_to_all(self, objs: list[Any], members: Members, timeout: float | None = None) -> list[Any]:
        """Personalised exchange; see `Collectives.all_to_all`."""
        return self.collectives.all_to_all(objs, members, timeout)

    # -- lifecycle -----------------------------------------------------------------------------
    def pending(self) -> dict[str, int]:
        """Counts of in-flight work, for diagnostics and tests."""
        return {
            "links_live": self.links.live(),
            "links_created": self.links.created,
            "batches": sum(1 for b in self._batches.values() if b.headers),
            "sends_in_flight": len(self._ledger),
            **self._inbox.counts(),
        }

    def free(self) -> None:
        """Release the data communicator (after the last transfer)."""
        self.collectives.free()
        if self._comm != mpi().COMM_NULL:
            self._comm.Free()
