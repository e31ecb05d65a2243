"""Point-to-point transfers of structured objects between any two ranks.

Every transfer starts with an *envelope* (see `wire`) on its own MPI tag; leaves too large to
ride inside it follow as raw payload messages, chunked, on a second tag. MPI keeps messages
between two ranks on one tag in order, so payloads always match the envelope before them.

* Sends (see `outbox`): small asynchronous ones (< ``coalesce_below``) to one destination are
  copied into a batch that leaves as one MPI message when it is full or when anyone waits; a
  blocking send of one tiny tensor/array builds its envelope from a cached header (`tiny`);
  large leaves are sent zero-copy from their own memory (after a contiguous/host staging copy
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
from collections.abc import Callable, Iterable
from typing import Any

from rlinf_hpc.comm.collectives import Collectives, Members
from rlinf_hpc.comm.directory import Address, Directory
from rlinf_hpc.comm.handles import WorkHandle
from rlinf_hpc.comm.inbox import MISSING, NOTHING, Inbox
from rlinf_hpc.comm.links import Links
from rlinf_hpc.comm.mpi import mpi, world
from rlinf_hpc.comm.outbox import BLOCKING_WAIT_BYTES, Outbox
from rlinf_hpc.comm.packing import pack
from rlinf_hpc.comm.sending import CommOptions
from rlinf_hpc.errors import CommTimeoutError

_ENVELOPE_TAG = 21
_PAYLOAD_TAG = 22  # (23: transfers resent after their link failed, `links.RESEND_TAG`)
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
        self._directory_listeners: list[Callable[[Directory, Directory], None]] = []
        self._poll_hooks: list[weakref.WeakMethod] = []
        #: Called as hook(name, category, lane, start, end, **args) for each large transfer.
        self.span_hook: Callable[..., None] | None = None
        self.links = Links(self.rank, self.options.link_timeout_s, self._comm)
        self._inbox = Inbox(self._comm, _ENVELOPE_TAG, _PAYLOAD_TAG, self._name, self.links, device)
        self.collectives = Collectives(self, self._comm)
        #: Counters for diagnostics and tests (monotonic over the plane's life).
        self.stats = {
            "envelopes_sent": 0,
            "payload_messages_sent": 0,
            "bytes_sent": 0,
            "messages_coalesced": 0,
        }
        self._outbox = Outbox(
            self._comm,
            _ENVELOPE_TAG,
            _PAYLOAD_TAG,
            self.options,
            self.links,
            lambda: self.directory,
            self.poll,
            self._record,
            self.stats,
        )

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
        envelope = self._outbox.tiny_envelope(obj, tag)
        if envelope is not None:  # a small tensor/array: cached header, no handle if eager
            self._outbox.send_tiny(envelope, self.resolve(dst), tag, timeout)
            return
        self._outbox.start(obj, self.resolve(dst), tag, coalesce=False).wait(timeout)

    def isend(self, obj: Any, dst: Address, tag: Any = 0, coalesce: bool = True) -> WorkHandle:
        """Start sending ``obj``; returns a handle. Buffers must stay unchanged until it is done
        (small coalesced messages are copied at once and are safe to change immediately).

        The handle may be dropped unwaited: the data plane keeps the message's buffers until
        MPI has sent them. An object that cannot travel raises here (TypeError naming the path
        inside it), never later when a batch leaves, so other messages are not affected.
        """
        return self._outbox.start(obj, self.resolve(dst), tag, coalesce)

    def isend_synchronous(self, obj: Any, dst: Address, tag: Any = 0) -> WorkHandle:
        """`isend` whose handle completes only once the receiver has taken the message in (MPI
        synchronous mode), never coalesced: the collectives learn when a peer has posted the
        receive of what follows."""
        return self._outbox.start(obj, self.resolve(dst), tag, coalesce=False, synchronous=True)

    def keep_until_sent(self, requests: list[Any], buffers: list[Any]) -> None:
        """Keep ``buffers`` alive until MPI is done with ``requests`` (sends posted outside the
        data plane's own paths, e.g. the collectives' bulk bytes), whatever the caller does."""
        self._outbox.keep_until_sent(requests, buffers)

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
        self._outbox.flush()
        self._inbox.pull_any()

    def add_poll_hook(self, method: Callable[[], None]) -> None:
        """Run the bound ``method`` on every `poll` while its object lives (channels send the
        acknowledgements they owe); held weakly, so a dropped channel stops being polled."""
        self._poll_hooks.append(weakref.WeakMethod(method))

    def flush(self) -> None:
        """Send every pending batch of small messages now."""
        self._outbox.flush()

    def progress(self) -> None:
        """Flush batches and let finished sends release their buffers (call when idle)."""
        self._outbox.progress()

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
            if self._outbox.batching:
                self._outbox.flush()
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

    def ready_from(self, sources: Iterable[int], tag: Any = 0) -> list[int]:
        """The world ranks among ``sources`` with a complete message for ``tag`` here (for
        `try_recv` to take), found with one probe loop over every source."""
        return self._inbox.ready_from(sources, tag)

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
            if waiter.item is not None or self._inbox.bytes_landing(rank, tag) < BLOCKING_WAIT_BYTES:
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
        if self.span_hook is not None and nbytes >= BLOCKING_WAIT_BYTES:
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
            "link_resends": self.links.resends,
            **self._outbox.counts(),
            **self._inbox.counts(),
        }

    def free(self) -> None:
        """Release the data communicator (after the last transfer)."""
        self.collectives.free()
        if self._comm != mpi().COMM_NULL:
            self._comm.Free()
