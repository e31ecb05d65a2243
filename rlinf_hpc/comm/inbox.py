"""The receive side of the data plane: envelopes in, objects out, in order per (source, tag).

When an envelope arrives its payload receives are posted at once (MPI matches payloads in
order), into the caller's ``out=`` buffers when a fitting receive was posted already, or else
into fresh tensors/arrays of the final dtype and shape. Completed messages are handed to
posted receives in order; messages nobody asked for yet wait in a per-source stash.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from rlinf_hpc.comm import wire
from rlinf_hpc.comm.buffers import allocate_leaf, copy_leaf, leaf_from_bytes, out_mismatch, writable_view
from rlinf_hpc.comm.links import Links
from rlinf_hpc.comm.mpi import mpi
from rlinf_hpc.comm.packing import Leaf, leaf_nbytes, leaf_nodes, unpack
from rlinf_hpc.comm.routing import HOST, INLINE, LINK_ROUTES, NCCL
from rlinf_hpc.comm.tiny import TinyDecoder

#: What `Inbox.take_tiny` returns when it has no value (MISSING: look in the stash; NOTHING:
#: no message from that source has arrived at all).
MISSING = object()
NOTHING = object()


class Incoming:
    """A message whose envelope has arrived; its payload may still be landing."""

    __slots__ = ("description", "in_place", "nbytes", "nodes", "requests", "sums", "tag", "values", "works")

    def __init__(
        self,
        tag: Any,
        description: Any,
        nodes: list[tuple],
        values: list[Any],
        requests: list[Any],
        nbytes: int,
        in_place: bool,
        works: list[Any] | None = None,
        sums: list[int] | None = None,
    ) -> None:
        self.tag = tag
        self.description = description
        self.nodes = nodes
        #: Leaf objects in leaf order (filled once ``requests`` complete).
        self.values = values
        self.requests = requests
        self.nbytes = nbytes
        #: True when the payload landed directly in the receiver's ``out`` buffers.
        self.in_place = in_place
        #: torch.distributed receives on links (NCCL/gloo) still in flight.
        self.works = works or []
        #: Integrity mode: the sender's CRC32 of each leaf, checked when the object is rebuilt.
        self.sums = sums

    def complete(self) -> bool:
        if self.requests and not mpi().Request.Testall(self.requests):
            return False
        self.requests = []
        if self.works:
            if not all(work.is_completed() for work in self.works):
                return False
            for work in self.works:
                work.wait()  # raises if the link failed and its bytes were not resent
                self.values[work.index] = work.value  # a resend lands in a tensor of its own
            self.works = []
        return True


class Waiter:
    """One posted receive: the message it gets, and the caller's buffers if any."""

    __slots__ = ("item", "out_leaves", "withdrawn")

    def __init__(self, out_leaves: list[Leaf] | None) -> None:
        self.out_leaves = out_leaves
        self.item: Incoming | None = None
        #: Set when its wait timed out and it stopped being posted (see `Inbox.withdraw`).
        self.withdrawn = False


class Inbox:
    """Per-rank receive state over the data communicator."""

    def __init__(
        self,
        comm: Any,
        envelope_tag: int,
        payload_tag: int,
        name_of: Callable[[int], str],
        links: Links,
        device: str,
    ) -> None:
        self._comm = comm
        self._links = links
        #: Device of NCCL receive buffers (the rank's device).
        self.device = device
        self._envelope_tag = envelope_tag
        self._payload_tag = payload_tag
        self._name_of = name_of
        self._stash: dict[tuple[int, Any], deque[Incoming]] = {}
        self._waiting: dict[tuple[int, Any], deque[Waiter]] = {}
        self._received_in_place = 0
        self._tiny = TinyDecoder()

    def post(self, rank: int, tag: Any, out_leaves: list[Leaf] | None) -> Waiter:
        waiter = Waiter(out_leaves)
        self._waiting.setdefault((rank, tag), deque()).append(waiter)
        return waiter

    def progress(self, rank: int) -> None:
        """Take in envelopes from ``rank`` and hand completed messages to posted receives."""
        self._pull_envelopes(rank)
        for key in [k for k in self._waiting if k[0] == rank]:
            waiters, stash = self._waiting[key], self._stash.get(key)
            while waiters and stash and stash[0].complete():  # order per (source, tag)
                waiters.popleft().item = stash.popleft()
            if not waiters:
                del self._waiting[key]
            if not stash:
                self._stash.pop(key, None)

    def withdraw(self, rank: int, tag: Any, waiter: Waiter) -> bool:
        """Stop ``waiter`` being posted (its wait timed out); False when its message has
        arrived already (the envelope is here and its bytes are landing), so it must finish."""
        key = (rank, tag)
        waiters = self._waiting.get(key)
        if waiters is None or waiter not in waiters:
            return waiter.item is None
        if list(waiters).index(waiter) < len(self._stash.get(key, ())):
            return False  # the i-th stashed message belongs to the i-th posted receive
        waiters.remove(waiter)
        if not waiters:
            del self._waiting[key]
        waiter.withdrawn = True
        return True

    def pull_any(self) -> None:
        """Take in envelopes from every source (a sender waiting here must not block a peer
        that is sending to this rank at the same moment)."""
        self._pull_envelopes(mpi().ANY_SOURCE)

    def _pull_envelopes(self, source: int) -> None:
        while (arrived := self._next_envelope(source)) is not None:
            rank, envelope = arrived
            self._accept(rank, *self._decode(rank, envelope)[:2])

    def _next_envelope(self, source: int) -> tuple[int, bytearray] | None:
        """(sender, bytes) of the next envelope from ``source`` MPI has here, or None."""
        MPI = mpi()
        status = MPI.Status()
        message = self._comm.Improbe(source, self._envelope_tag, status)
        if message is None:
            return None
        envelope = bytearray(status.Get_count(MPI.BYTE))
        message.Recv([envelope, MPI.BYTE])
        return status.Get_source(), envelope

    def _decode(self, rank: int, envelope: bytearray) -> tuple[Any, memoryview, bool]:
        """`TinyDecoder.decode`, with the sender named if the envelope does not decode."""
        try:
            return self._tiny.decode(envelope)
        except wire.CorruptMessageError as error:
            raise wire.CorruptMessageError(f"message from {self._name_of(rank)}: {error}") from None

    def take_tiny(self, rank: int, tag: Any) -> Any:
        """The value of the next message from (rank, tag) if it is a tiny tensor/array (see
        `tiny`) that MPI has here and nothing is stashed or posted before it; else `MISSING`
        (whatever arrived instead is taken in the general way), or `NOTHING` when no envelope
        from ``rank`` is here at all. The receive fast path of a blocking `recv`: no message
        record, no stash, nothing unpickled."""
        key = (rank, tag)
        if key in self._waiting or self._stash.get(key):
            return MISSING
        arrived = self._next_envelope(rank)
        if arrived is None:
            return NOTHING
        header, tail, tiny = self._decode(rank, arrived[1])
        if not tiny or header[1] != tag:
            self._accept(rank, header, tail)
            return MISSING
        return leaf_from_bytes(header[2], tail)

    def _accept(self, rank: int, header: Any, tail: memoryview) -> None:
        if header[0] == "M":
            offset = 0
            for blob in header[1]:
                tag, description = wire.decode_message(blob)
                item, offset = self._fill_inline(rank, tag, description, tail, offset)
                self._stash.setdefault((rank, tag), deque()).append(item)
            return
        _, tag, description, inline, chunk, *routing = header
        if inline:
            item = self._fill_inline(rank, tag, description, tail, 0)[0]
            self._stash.setdefault((rank, tag), deque()).append(item)
            return
        nodes = leaf_nodes(description)
        routes = self._link_routes(rank, routing, len(nodes))
        works: list[Any] = []
        views: list[memoryview | None] = []
        if any(route in LINK_ROUTES for route in routes):
            values = []
            # the message's number on each link it uses (the sender counted the same way)
            used = set(routes) & set(LINK_ROUTES)
            links = {route: self._links.incoming(rank, route, None) for route in used}
            numbers = {route: link.next_message() for route, link in links.items()}
            for index, (node, route) in enumerate(zip(nodes, routes, strict=True)):
                if route in LINK_ROUTES:
                    value = self._link_buffer(node, route)
                    works.append(self._links.receive(links[route], value, node, numbers[route], index))
                    view = None
                else:
                    value, view = allocate_leaf(node)
                values.append(value)
                views.append(view)
            in_place = False
        else:
            targets, in_place = self._targets(rank, tag, nodes)
            values, views = [v for v, _ in targets], [view for _, view in targets]
        requests = []
        offset = 0
        for view, route in zip(views, routes, strict=True):
            if route == INLINE:  # a small leaf that rode in the envelope's tail
                view[:] = tail[offset : offset + len(view)]
                offset += len(view)
            elif route == HOST:
                for start in range(0, len(view), chunk):
                    piece = view[start : start + chunk]
                    requests.append(self._comm.Irecv([piece, mpi().BYTE], rank, self._payload_tag))
        nbytes = sum(leaf_nbytes(node) for node in nodes)
        self._stash.setdefault((rank, tag), deque()).append(
            Incoming(tag, description, nodes, values, requests, nbytes, in_place, works, routing[2])
        )

    def _link_routes(self, rank: int, routing: list[Any], count: int) -> list[str]:
        """Per-leaf routes of a large message, after setting up any new link it announces.

        A link that cannot be set up sends its leaves over the host path: the sender fails the
        same rendezvous and does the same.
        """
        routes, setups = routing[0], routing[1]
        for setup in setups:
            if self._links.incoming(rank, setup[0], setup) is None:
                routes = [HOST if r == setup[0] else r for r in routes]
        for route in set(routes) - {HOST, INLINE}:
            if self._links.incoming(rank, route, None) is None:
                raise RuntimeError(
                    f"{self._name_of(rank)} sent over a {route} link that this rank no longer has "
                    "(released by a re-partition while the message was in flight)"
                )
        return list(routes)

    def _link_buffer(self, node: tuple, route: str) -> Any:
        import torch

        device = self.device if route == NCCL else "cpu"
        return torch.empty(node[3], dtype=getattr(torch, node[2]), device=device)

    def _targets(self, rank: int, tag: Any, nodes: list[tuple]) -> tuple[list[Any], bool]:
        """Where each leaf of a new message lands: the out= buffers of the receive that will
        get it, when that receive is posted already and they fit, else fresh allocations."""
        waiters = self._waiting.get((rank, tag))
        if waiters:
            ahead = len(self._stash.get((rank, tag), ()))
            waiter = waiters[ahead] if ahead < len(waiters) else None
            if (
                waiter is not None
                and waiter.out_leaves is not None
                and out_mismatch(nodes, waiter.out_leaves) is None
            ):
                views = [writable_view(leaf) for leaf in waiter.out_leaves]
                if all(view is not None for view in views):
                    pairs = zip(waiter.out_leaves, views, strict=True)
                    self._received_in_place += 1
                    return [(leaf.value, view) for leaf, view in pairs], True
        return [allocate_leaf(node) for node in nodes], False

    def _fill_inline(
        self, rank: int, tag: Any, description: Any, tail: memoryview, offset: int
    ) -> tuple[Incoming, int]:
        nodes = leaf_nodes(description)
        start = offset
        waiters = self._waiting.get((rank, tag))
        if waiters and any(w.out_leaves is not None for w in waiters):
            targets, in_place = self._targets(rank, tag, nodes)
            for _, view in targets:
                view[:] = tail[offset : offset + len(view)]
                offset += len(view)
            values = [value for value, _ in targets]
        else:  # the common small-message path: build each leaf straight from its bytes
            in_place = False
            values = []
            for node in nodes:
                size = leaf_nbytes(node)
                values.append(leaf_from_bytes(node, tail[offset : offset + size]))
                offset += size
        return Incoming(tag, description, nodes, values, [], offset - start, in_place), offset

    def finish(self, item: Incoming, rank: int, device: str, out_leaves: list[Leaf] | None) -> Any:
        """Rebuild the object of a completed message (copying into out= if not in place)."""
        nodes, values = item.nodes, item.values
        if item.sums is not None:
            self._verify(item, rank)
        if out_leaves is not None and not item.in_place:
            problem = out_mismatch(nodes, out_leaves)
            if problem is not None:
                raise ValueError(
                    f"receive buffer mismatch: {self._name_of(rank)} sent a message (tag "
                    f"{item.tag!r}) that does not fit out=: {problem}"
                )
            for leaf, value in zip(out_leaves, values, strict=True):
                copy_leaf(leaf, value)
            values = [leaf.value for leaf in out_leaves]
        elif out_leaves is None and device != "cpu":
            values = [v.to(device) if n[0] == "T" else v for v, n in zip(values, nodes, strict=True)]
        return unpack(item.description, values)

    def _verify(self, item: Incoming, rank: int) -> None:
        for index, (node, value, expected) in enumerate(zip(item.nodes, item.values, item.sums, strict=True)):
            actual = wire.checksum(Leaf(node[0], value, leaf_nbytes(node)).host_bytes())
            if actual != expected:
                raise wire.CorruptMessageError(
                    f"payload leaf {index} of a message from {self._name_of(rank)} (tag {item.tag!r}, "
                    f"{item.nbytes} bytes) failed its checksum ({actual:#010x} != {expected:#010x})"
                )

    def take_ready(self, rank: int, tag: Any) -> Incoming | None:
        """The next complete message from (rank, tag) if no posted receive is ahead of it."""
        key = (rank, tag)
        if key in self._waiting:
            return None
        stash = self._stash.get(key)
        if not stash:
            self._pull_envelopes(rank)
            stash = self._stash.get(key)
        if stash and stash[0].complete():
            item = stash.popleft()
            if not stash:
                del self._stash[key]
            return item
        return None

    def ready_from(self, ranks: Iterable[int], tag: Any) -> list[int]:
        """Those of ``ranks`` whose next message with ``tag`` is complete and not claimed by a
        posted receive, after taking in every envelope here once (one probe loop, not one per
        rank: a producer with 24 consumers polled 24 sources per put)."""
        self.pull_any()
        ready = []
        for rank in ranks:
            key = (rank, tag)
            stash = self._stash.get(key)
            if stash and stash[0].complete() and key not in self._waiting:
                ready.append(rank)
        return ready

    def bytes_landing(self, rank: int, tag: Any) -> int:
        """Payload bytes of the oldest message from (rank, tag) still landing; 0 if none."""
        stash = self._stash.get((rank, tag))
        if not stash or not stash[0].requests:
            return 0
        return stash[0].nbytes

    def finish_landing(self, rank: int, tag: Any) -> None:
        """Block (in MPI, GIL released) until the oldest message from (rank, tag) has landed.

        Only called once its payload receives are posted: the sender posted its sends together
        with the envelope, so the bytes are moving, and MPI's own wait loop keeps a large
        shared-memory transfer pipelined far better than polling from Python can.
        """
        stash = self._stash.get((rank, tag))
        if stash and stash[0].requests:
            mpi().Request.Waitall(stash[0].requests)

    def counts(self) -> dict[str, int]:
        return {
            "stashed": sum(len(s) for s in self._stash.values()),
            "receives_waiting": sum(len(w) for w in self._waiting.values()),
            "received_in_place": self._received_in_place,
        }
