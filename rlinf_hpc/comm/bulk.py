"""Bulk bytes of the collectives: zero-copy MPI messages, every pair's posted at once.

A collective moves each member's object in two parts. Its *description* (the packed nesting,
the small leaves' bytes, and a bulk tag) travels as an ordinary data-plane message, stamped with
the operation, so that a missing member or a mismatched call is named exactly as for P2P. Its
large host leaves travel as plain contiguous MPI messages from the leaves' own memory, one per
leaf on the pair's bulk tag (MPI keeps their order), posted once the receiver has taken the
description in, and the receiver posts every pair's receives at once, into buffers of the final
dtype and shape, before it waits — the work MPI's own ``Alltoallv``/``Gatherv`` do, without
first packing the leaves into one buffer.

Measured here (MPICH 5, 8 ranks): one ``hindexed`` datatype over all of a pair's leaves
(``MPI.BOTTOM``) is far slower than contiguous messages — MPICH packs non-contiguous
datatypes through small staging buffers, one piece per progress call. And a member set needs
no communicator of its own (``Alltoallw`` would need one; creating it blocks without a timeout
until every member arrives).

Objects with large leaves on a GPU are not split: they travel whole through the data plane,
whose routes (NCCL links, staged copies) are made for them.
"""

from __future__ import annotations

import itertools
import pickle
from dataclasses import dataclass
from typing import Any

from rlinf_hpc.comm import wire
from rlinf_hpc.comm.buffers import allocate_leaf, leaf_from_bytes
from rlinf_hpc.comm.mpi import mpi
from rlinf_hpc.comm.packing import leaf_nodes, pack, unpack

#: MPI counts are C ints: larger leaves travel as several messages of at most this size.
_BLOCK = 1 << 30


class Split:
    """One object prepared for a collective: what travels as a message, and its bulk bytes."""

    __slots__ = ("bulk", "message")

    def __init__(self, message: Any, bulk: list[memoryview]) -> None:
        self.message = message
        self.bulk = bulk

    def wire(self) -> tuple[str, bytes]:
        """The description message as it travels: pickled once here, so that the data plane
        sends it as one bytes leaf instead of packing the description's every node again
        (CPU the copying ranks need when a node's cores are oversubscribed)."""
        return ("bulk", pickle.dumps(self.message[1:], protocol=pickle.HIGHEST_PROTOCOL))


def split(obj: Any, inline_below: int, verify: bool) -> Split | None:
    """``obj`` as a description message plus bulk host views, or None when it should travel
    whole (a large leaf on a GPU device)."""
    description, leaves = pack(obj)
    small: list[bytes | None] = []
    bulk: list[memoryview] = []
    for leaf in leaves:
        if leaf.nbytes < inline_below:
            small.append(bytes(leaf.host_bytes()))
        elif leaf.kind == "T" and leaf.device != "cpu":
            return None
        else:
            small.append(None)
            bulk.append(leaf.host_bytes())
    sums = [wire.checksum(view) for view in bulk] if verify else None
    return Split(["bulk", description, small, sums, None], bulk)


def _pieces(views: list[memoryview]) -> list[memoryview]:
    """The non-empty views, split into messages of at most ``_BLOCK`` bytes."""
    return [view[start : start + _BLOCK] for view in views for start in range(0, len(view), _BLOCK)]


class Bulk:
    """The bulk-bytes communicator of one rank's data plane (a duplicate of its communicator,
    so these messages never match the data plane's own)."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm.Dup()
        self._comm.Set_name("rlinf_hpc.bulk")
        tag_ub = self._comm.Get_attr(mpi().TAG_UB) or 32767
        self._tags = itertools.cycle(range(1, tag_ub))

    def stamp(self, split: Split) -> bool:
        """Give ``split.message`` a fresh bulk tag if it has bulk bytes; True if it does."""
        if not any(len(view) for view in split.bulk):
            return False
        split.message[4] = next(self._tags)
        return True

    def post_send(self, split: Split, dst: int) -> list[Any]:
        """Post the bulk bytes of a `stamp`-ed ``split`` to ``dst``; returns the requests."""
        tag = split.message[4]
        return [self._comm.Isend([piece, mpi().BYTE], dst, tag) for piece in _pieces(split.bulk)]

    def post_recv(self, message: tuple[str, bytes], src: int) -> Incoming:
        """Allocate the object a description message (`Split.wire`) announces and post the receive of its
        bulk bytes from ``src``."""
        description, small, sums, tag = pickle.loads(message[1])
        nodes = leaf_nodes(description)
        values: list[Any] = []
        views: list[memoryview] = []
        for node, data in zip(nodes, small, strict=True):
            if data is not None:
                values.append(leaf_from_bytes(node, memoryview(data)))
                continue
            value, view = allocate_leaf(node)
            values.append(value)
            views.append(view)
        requests = []
        if tag is not None:
            requests = [self._comm.Irecv([piece, mpi().BYTE], src, tag) for piece in _pieces(views)]
        return Incoming(description, nodes, values, views, sums, requests)

    def free(self) -> None:
        if self._comm != mpi().COMM_NULL:
            self._comm.Free()


@dataclass(slots=True)
class Incoming:
    """A posted bulk receive and the object it fills."""

    description: Any
    nodes: list[tuple]
    values: list[Any]
    views: list[memoryview]
    sums: list[int] | None
    requests: list[Any]

    def cancel(self) -> None:
        """Withdraw the receives that have not completed (a collective gave up on them)."""
        for request in self.requests:
            if not request.Test():
                request.Cancel()
                request.Wait()

    def result(self, device: str, sender: str) -> Any:
        """The rebuilt object (once the requests completed); tensors moved to ``device``."""
        if self.sums is not None:
            for index, (view, expected) in enumerate(zip(self.views, self.sums, strict=True)):
                actual = wire.checksum(view)
                if actual != expected:
                    raise wire.CorruptMessageError(
                        f"bulk leaf {index} of a collective message from {sender} ({len(view)} "
                        f"bytes) failed its checksum ({actual:#010x} != {expected:#010x})"
                    )
        values = self.values
        if device != "cpu":
            values = [v.to(device) if n[0] == "T" else v for v, n in zip(values, self.nodes, strict=True)]
        return unpack(self.description, values)
