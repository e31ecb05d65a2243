"""The control plane: small pickled messages between the coordinator (rank 0) and workers.

Runs on a duplicate of COMM_WORLD so that user and data traffic can never match its tags.
Sends are non-blocking; receives are probes plus back-off sleeps, so idle ranks do not spin.
Payload-heavy traffic (tensors) belongs to the data plane, not here.
"""

from __future__ import annotations

from typing import Any

from rlinf_hpc.comm.mpi import mpi, world
from rlinf_hpc.comm.waiting import poll_until

COORDINATOR_RANK = 0
_COMMAND_TAG = 11
_REPLY_TAG = 12
_ANSWER_TAG = 13  # answers to a worker's requests, apart from its command stream


class ControlPlane:
    """Coordinator <-> worker messages. Create it on every rank at the same time (collective)."""

    def __init__(self) -> None:
        self._comm = world().Dup()
        self._comm.Set_name("rlinf_hpc.control")
        self.rank: int = self._comm.Get_rank()
        self.size: int = self._comm.Get_size()
        self._pending_sends: list[Any] = []

    # -- collective start-up helpers -------------------------------------------------------
    def broadcast_from_coordinator(self, obj: Any) -> Any:
        """Every rank gets rank 0's ``obj``. Brief and collective: used once at start-up."""
        return self._comm.bcast(obj, root=COORDINATOR_RANK)

    def gather_to_coordinator(self, obj: Any) -> list[Any] | None:
        """Rank 0 gets every rank's ``obj`` in rank order; other ranks get None."""
        return self._comm.gather(obj, root=COORDINATOR_RANK)

    # -- sending ---------------------------------------------------------------------------
    def _isend(self, obj: Any, dest: int, tag: int) -> None:
        self._pending_sends.append(self._comm.isend(obj, dest=dest, tag=tag))
        self._reap_sends()

    def _reap_sends(self) -> None:
        if self._pending_sends:
            self._pending_sends = [r for r in self._pending_sends if not r.Test()]

    def send_command(self, rank: int, message: Any) -> None:
        """Coordinator -> worker ``rank``; returns at once."""
        self._isend(message, rank, _COMMAND_TAG)

    def send_reply(self, message: Any) -> None:
        """Worker -> coordinator; returns at once."""
        self._isend(message, COORDINATOR_RANK, _REPLY_TAG)

    def flush(self, timeout: float, describe: str = "control plane flush") -> None:
        """Wait (sleeping, not spinning) until every message sent from here has left."""

        def poll() -> bool | None:
            self._reap_sends()
            return True if not self._pending_sends else None

        poll_until(poll, timeout, lambda: f"rank {self.rank}: {describe}")

    # -- receiving -------------------------------------------------------------------------
    def _try_receive(self, source: int, tag: int) -> tuple[int, Any] | None:
        self._reap_sends()
        status = mpi().Status()
        message = self._comm.improbe(source=source, tag=tag, status=status)
        if message is None:
            return None
        return status.Get_source(), message.recv()

    def try_receive_reply(self) -> tuple[int, Any] | None:
        """Coordinator: the next reply from any worker as (rank, message), or None."""
        return self._try_receive(mpi().ANY_SOURCE, _REPLY_TAG)

    def try_receive_command(self) -> Any | None:
        """Worker: the next command from the coordinator, or None."""
        received = self._try_receive(COORDINATOR_RANK, _COMMAND_TAG)
        return None if received is None else received[1]

    def send_answer(self, rank: int, message: Any) -> None:
        """Coordinator -> worker ``rank``: the answer to its request."""
        self._isend(message, rank, _ANSWER_TAG)

    def request(self, message: Any, timeout: float, describe: str) -> Any:
        """Worker: send ``message`` to the coordinator and wait (sleeping) for its answer."""
        self.send_reply(message)

        def poll() -> Any:
            received = self._try_receive(COORDINATOR_RANK, _ANSWER_TAG)
            return None if received is None else received[1]

        return poll_until(poll, timeout, lambda: f"rank {self.rank} waited for the coordinator to {describe}")

    def free(self) -> None:
        """Release the duplicated communicator (after the last message)."""
        if self._comm != mpi().COMM_NULL:
            self._comm.Free()
