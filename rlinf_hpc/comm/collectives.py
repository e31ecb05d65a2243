"""broadcast / gather / all_to_all over any set of ranks, built on the data plane's P2P.

Members are a list of addresses (world ranks or ``(component, group_rank)``) or a component
name. No communicator has to exist for the set: each collective is a set of tagged P2P
messages, tagged with the member set and a per-set sequence number, and stamped with the
operation and root so that ranks calling different collectives get an error naming both
instead of a hang. A member that never arrives is named in the timeout error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlinf_hpc.comm.waiting import waiting_on
from rlinf_hpc.errors import CommTimeoutError

if TYPE_CHECKING:
    from rlinf_hpc.comm.dataplane import DataPlane

Members = Sequence[Any] | str


class CollectiveMismatchError(RuntimeError):
    """Ranks of one member set called different collectives (or different roots)."""


class Collectives:
    """Collective operations of one rank's data plane."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self._sequence: dict[tuple[int, ...], int] = {}

    def _members(self, members: Members) -> tuple[int, ...]:
        if isinstance(members, str):
            if members not in self.plane.directory.groups:
                raise ValueError(f"no component '{members}' to run a collective over")
            ranks = list(self.plane.directory.groups[members])
        else:
            ranks = [self.plane.resolve(m) for m in members]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"collective members list a rank twice: {ranks}")
        if self.plane.rank not in ranks:
            raise ValueError(
                f"rank {self.plane.rank} called a collective over ranks {ranks} that it is not part of"
            )
        return tuple(ranks)

    def _begin(self, members: Members) -> tuple[tuple[int, ...], int]:
        key = self._members(members)
        number = self._sequence.get(key, 0) + 1
        self._sequence[key] = number
        return key, number

    def _recv(
        self, op: str, root: int, key: tuple[int, ...], number: int, src: int, timeout: float | None
    ) -> Any:
        try:
            sent_op, sent_root, value = self.plane.recv(src, ("coll", key, number), timeout=timeout)
        except CommTimeoutError as exc:
            raise CommTimeoutError(
                f"in {op} #{number} over ranks {list(key)} (root {root}): {exc}; did "
                f"{self.plane.directory.name_of(src)} call {op} with the same members?"
            ) from None
        if (sent_op, sent_root) != (op, root):
            raise CollectiveMismatchError(
                f"{self.plane.directory.name_of(self.plane.rank)} called {op} (root {root}) as "
                f"collective #{number} over ranks {list(key)}, but "
                f"{self.plane.directory.name_of(src)} called {sent_op} (root {sent_root})"
            )
        return value

    def _op(self, op: str, key: tuple[int, ...], number: int) -> Any:
        """The wait record of one collective (the same text on every member: `waiting_on`)."""
        return waiting_on(f"{op} #{number} over ranks {list(key)}", key)

    def broadcast(self, obj: Any, root: Any, members: Members, timeout: float | None = None) -> Any:
        """``root``'s ``obj`` on every member (root passes the object; others pass None).

        A binomial tree: every member that has the object forwards it (zero-copy, from what it
        received) to the members below it, so the root sends ceil(log2 N) copies instead of
        N - 1 and the time grows with log N. Non-root members return the received object.

        >>> [tree_children(v, 8) for v in range(8)]
        [[4, 2, 1], [], [3], [], [6, 5], [], [7], []]
        """
        key, number = self._begin(members)
        root_rank = self.plane.resolve(root)
        if root_rank not in key:
            raise ValueError(f"broadcast root {root_rank} is not among members {list(key)}")
        tag = ("coll", key, number)
        size, start = len(key), key.index(root_rank)
        relative = (key.index(self.plane.rank) - start) % size
        with self._op("broadcast", key, number):
            if relative == 0:
                value = obj
            else:
                parent = key[(tree_parent(relative) + start) % size]
                value = self._recv("broadcast", root_rank, key, number, parent, timeout)
            handles = [
                self.plane.isend(
                    ("broadcast", root_rank, value), key[(child + start) % size], tag, coalesce=False
                )
                for child in tree_children(relative, size)
            ]
            for handle in handles:
                handle.wait(timeout)
        return value

    def gather(self, obj: Any, root: Any, members: Members, timeout: float | None = None) -> list[Any] | None:
        """Every member's ``obj`` on ``root`` in member order; None elsewhere."""
        key, number = self._begin(members)
        root_rank = self.plane.resolve(root)
        if root_rank not in key:
            raise ValueError(f"gather root {root_rank} is not among members {list(key)}")
        with self._op("gather", key, number):
            if self.plane.rank != root_rank:
                self.plane.send(("gather", root_rank, obj), root_rank, ("coll", key, number), timeout=timeout)
                return None
            return [
                obj if r == root_rank else self._recv("gather", root_rank, key, number, r, timeout)
                for r in key
            ]

    def all_to_all(self, objs: Sequence[Any], members: Members, timeout: float | None = None) -> list[Any]:
        """Member i sends ``objs[j]`` to member j; returns what each member sent to this one."""
        key, number = self._begin(members)
        if len(objs) != len(key):
            raise ValueError(f"all_to_all needs one object per member ({len(key)}), got {len(objs)}")
        tag = ("coll", key, number)
        me = key.index(self.plane.rank)
        with self._op("all_to_all", key, number):
            handles = [
                self.plane.isend(("all_to_all", -1, objs[j]), r, tag, coalesce=False)
                for j, r in enumerate(key)
                if r != self.plane.rank
            ]
            received = [
                objs[me] if r == self.plane.rank else self._recv("all_to_all", -1, key, number, r, timeout)
                for r in key
            ]
            for handle in handles:
                handle.wait(timeout)
        return received


def tree_parent(relative: int) -> int:
    """Parent of a member in the binomial broadcast tree (members numbered from the root; also
    used by weight sync)."""
    return relative - (relative & -relative)


def tree_children(relative: int, size: int) -> list[int]:
    """Children of a member in the binomial tree, farthest first (they forward the most)."""
    top = relative & -relative if relative else 1 << max(size - 1, 0).bit_length()
    children, mask = [], top >> 1
    while mask:
        if relative + mask < size:
            children.append(relative + mask)
        mask >>= 1
    return children
