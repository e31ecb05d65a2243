"""`Calls`: the coordinator's commands in flight and what comes back for them.

Every command the coordinator sends gets a `CallFuture` here before it leaves; `pump` routes
what the workers send back — replies resolve their futures, a worker's request (e.g. a channel
declared from inside a method) goes to the coordinator's handler, and a rank's departure
(``Bye``) fails every command it still held. A failure nobody waits for (a directory update
sent without waiting, a rank that left outside a shutdown) is kept as the job's fatal error and
raised at the coordinator's next wait or command, so it can never end in a silent success.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from rlinf_hpc.comm import ControlPlane, DataPlane, poll_until
from rlinf_hpc.errors import WorkerError, WorkerInterrupted
from rlinf_hpc.scheduler.futures import CallFuture, GroupFuture
from rlinf_hpc.scheduler.protocol import Bye, Call, Reply, Request

#: A worker's `Bye` reason when it left on a signal (`JobInterrupted.signal_name`).
_SIGNALS = frozenset({"SIGINT", "SIGTERM"})


class Calls:
    """The ledger of one coordinator's commands (see the module docstring)."""

    def __init__(
        self,
        control: ControlPlane,
        comm: DataPlane | None,
        call_timeout_s: float,
        serve_request: Callable[[int, Request], None],
        components_on: Callable[[int], str],
    ) -> None:
        self.control = control
        self.comm = comm
        self.call_timeout_s = call_timeout_s
        self._serve_request = serve_request
        self._components_on = components_on  # a rank's components, for a departure's error
        self._next_call_id = 1
        self._pending: dict[int, dict[int, CallFuture]] = {}
        #: Rank -> its commands not answered yet.
        self.busy: dict[int, dict[int, CallFuture]] = defaultdict(dict)
        #: Rank -> how it left the job.
        self.departed: dict[int, Bye] = {}
        self.fatal: Exception | None = None
        #: Commands nobody waits for (directory updates sent without waiting).
        self.background: set[int] = set()
        #: Timeline spans the workers handed over when they left (see runtime.timeline).
        self.worker_spans: list[dict[str, Any]] = []

    # -- sending -----------------------------------------------------------------------------
    def new_future(self, rank: int, component: str, method: str) -> CallFuture:
        """Register a future for a command about to be sent to ``rank``."""
        self.raise_if_fatal()
        if rank in self.departed:
            raise WorkerError(rank, component, method, "the rank has left the job", "")
        call_id = self._next_call_id
        self._next_call_id += 1
        future = CallFuture(call_id, rank, component, method, self.wait_for)
        self._pending.setdefault(call_id, {})[rank] = future
        self.busy[rank][call_id] = future
        return future

    def send(
        self,
        component: str,
        ranks: list[int],
        method: str,
        per_rank_args: list[tuple[Any, ...]],
        kwargs: dict[str, Any],
    ) -> GroupFuture:
        """Send ``method`` to each rank; returns futures at once."""
        if not method or method.startswith("_"):
            raise ValueError(f"'{method}' is not a public worker method name")
        futures = []
        for rank, args in zip(ranks, per_rank_args, strict=True):
            future = self.new_future(rank, component, method)
            self.control.send_command(rank, Call(future.call_id, component, method, args, kwargs))
            futures.append(future)
        return GroupFuture(futures)

    def in_flight(self) -> list[str]:
        """Worker commands sent and not answered yet (background ones excluded), after routing
        every reply that has arrived."""
        while self.pump():
            pass
        return [
            future.describe()
            for calls in self.busy.values()
            for call_id, future in calls.items()
            if call_id not in self.background
        ]

    def wait_all(self, futures: list[CallFuture]) -> None:
        GroupFuture(futures).result(self.call_timeout_s)

    # -- receiving ---------------------------------------------------------------------------
    def raise_if_fatal(self) -> None:
        if self.fatal is not None:
            raise self.fatal

    def pump(self) -> bool:
        """Receive and route every reply that has arrived. True if any did.

        The data plane is polled first: the consumers of the streams this rank feeds keep
        sending it acknowledgements after the feed, and left in MPI they held up the replies
        sent after them — at 16 emulated ranks every reply of a step reached rank 0 0.4-1.0 s
        after its worker sent it, while rank 0 probed for replies every few milliseconds."""
        got = False
        if self.comm is not None:
            self.comm.poll()
        while (received := self.control.try_receive_reply()) is not None:
            self._handle(*received)
            got = True
        return got

    def wait_for(self, future: CallFuture, timeout: float | None) -> None:
        timeout = self.call_timeout_s if timeout is None else timeout

        def poll() -> bool | None:
            self.pump()
            # before the future's own answer: a failure on any rank (a command nobody waits
            # for, e.g. a directory update sent without waiting) ends the job at its next wait
            self.raise_if_fatal()
            return True if future.done() else None

        poll_until(
            poll,
            timeout,
            lambda: (
                f"coordinator (rank 0) waited for rank {future.rank} (component "
                f"'{future.component}') to finish {future.method} (call #{future.call_id})"
            ),
        )

    def _handle(self, rank: int, message: Reply | Bye | Request) -> None:
        if isinstance(message, Request):
            self._serve_request(rank, message)
            return
        if isinstance(message, Reply):
            future = self._pending.get(message.call_id, {}).pop(message.rank, None)
            self.busy[rank].pop(message.call_id, None)
            if not self._pending.get(message.call_id, True):
                del self._pending[message.call_id]
            if future is not None:
                future._resolve(message)
            if message.call_id in self.background:
                self.background.discard(message.call_id)
                if not message.ok and self.fatal is None:
                    self.fatal = WorkerError(
                        rank, message.component, "set_directory", message.error, message.traceback
                    )
            return
        self.departed[rank] = message
        self.worker_spans.extend(message.spans)
        lost = list(self.busy.pop(rank, {}).values())
        for future in lost:
            self._pending.get(future.call_id, {}).pop(rank, None)
            reason = message.error or f"the rank left the job ({message.reason})"
            future._resolve(
                Reply(
                    future.call_id, rank, future.component, False, error=reason, traceback=message.traceback
                )
            )
        if message.reason in _SIGNALS and not message.error and self.fatal is None:
            self.fatal = WorkerInterrupted(rank, self._components_on(rank) or "-", message.reason)
        elif message.reason != "shutdown" and self.fatal is None:
            self.fatal = WorkerError(
                rank,
                self._components_on(rank) or "-",
                "its service loop",
                message.error or message.reason,
                message.traceback,
            )
