"""Communicators for component groups, created and freed while the job runs.

``Comm.Create_group`` is collective only over the group's own members, so the coordinator
and ranks of other groups keep working while a group forms. Every live group communicator is
registered here so that tests (and leak checks) can see that re-partitioning frees old ones.
"""

from __future__ import annotations

from typing import Any

from rlinf_hpc.comm.mpi import mpi, world
from rlinf_hpc.comm.waiting import poll_until, waiting_on

_live: dict[int, GroupComm] = {}


class GroupComm:
    """An MPI communicator over a component group's ranks, with non-spinning helpers.

    ``rank``/``size`` are the caller's position in the group. Blocking object collectives
    (`allgather`, `allreduce`, `bcast`) are meant for small control values; the data plane
    moves tensors.
    """

    def __init__(self, name: str, world_ranks: list[int], comm: Any) -> None:
        self.name = name
        self.world_ranks = list(world_ranks)
        self._comm = comm
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        _live[id(self)] = self

    @property
    def freed(self) -> bool:
        """True once `free` ran."""
        return id(self) not in _live

    def barrier(self, timeout: float | None = None) -> None:
        """All group members reach this point; waits by polling, not spinning."""
        request = self._comm.Ibarrier()
        with waiting_on(f"barrier of group '{self.name}' (ranks {list(self.world_ranks)})", self.world_ranks):
            poll_until(
                lambda: True if request.Test() else None,
                timeout,
                lambda: (
                    f"group '{self.name}' rank {self.rank} waited in barrier for ranks {self.world_ranks}"
                ),
            )

    # The object collectives below are MPI's blocking ones, which busy-poll a core until the
    # last member arrives: members first meet in the polled (sleeping) `barrier`, so an early
    # one does not spin on the core a late one is still computing on. A group of one returns
    # its own object (no pickling round trip: the math actor's update gathered its whole batch
    # through one, ~5% of its time).

    def allgather(self, obj: Any) -> list[Any]:
        """Every member's ``obj`` in group-rank order (small control values)."""
        if self.size == 1:
            return [obj]
        self.barrier()
        return self._comm.allgather(obj)

    def allreduce(self, obj: Any) -> Any:
        """Sum (``+``) of ``obj`` over the group."""
        if self.size == 1:
            return obj
        self.barrier()
        return self._comm.allreduce(obj)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """``root``'s ``obj`` on every member (small control values)."""
        if self.size == 1:
            return obj
        self.barrier()
        return self._comm.bcast(obj, root=root)

    def torch_store(self, timeout_s: float = 300.0) -> Any:
        """A torch.distributed store over this group's MPI messages (`MPIStore`, on a
        communicator of its own): rendezvous for a process group with no TCP server.
        Collective: every member calls it."""
        from rlinf_hpc.comm.store import MPIStore

        return MPIStore(self._comm.Dup(), timeout_s=timeout_s)

    def free(self) -> None:
        """Release the communicator. Idempotent."""
        if self.freed:
            return
        del _live[id(self)]
        self._comm.Free()

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"rank {self.rank}/{self.size}"
        return f"GroupComm({self.name!r}, ranks={self.world_ranks}, {state})"


def create_group_comm(name: str, world_ranks: list[int], tag: int) -> GroupComm:
    """Collective over ``world_ranks`` only: every member calls this with the same arguments."""
    group = world().Get_group()
    try:
        sub_group = group.Incl(sorted(world_ranks))
        try:
            comm = world().Create_group(sub_group, tag)
        finally:
            sub_group.Free()
    finally:
        group.Free()
    if comm == mpi().COMM_NULL:
        raise RuntimeError(f"rank {world().Get_rank()} is not in group '{name}' {world_ranks}")
    comm.Set_name(f"rlinf_hpc.group.{name}")
    return GroupComm(name, sorted(world_ranks), comm)


def live_group_comms() -> list[GroupComm]:
    """Group communicators created on this rank and not yet freed."""
    return list(_live.values())
