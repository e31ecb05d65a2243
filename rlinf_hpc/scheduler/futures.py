"""Futures for commands sent to workers, resolved as the coordinator's pump receives replies."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rlinf_hpc.errors import WorkerError
from rlinf_hpc.scheduler.protocol import Reply


class CallFuture:
    """The result of one method call on one worker rank."""

    def __init__(
        self,
        call_id: int,
        rank: int,
        component: str,
        method: str,
        wait: Callable[[CallFuture, float | None], None],
    ) -> None:
        self.call_id = call_id
        self.rank = rank
        self.component = component
        self.method = method
        self._wait = wait
        self._reply: Reply | None = None
        #: ``time.monotonic()`` when the reply arrived (None before).
        self.resolved_at: float | None = None

    def _resolve(self, reply: Reply) -> None:
        self._reply = reply
        self.resolved_at = time.monotonic()

    def done(self) -> bool:
        """True once the worker's reply has arrived (success or error)."""
        return self._reply is not None

    def failed(self) -> bool:
        """True once an error reply has arrived."""
        return self._reply is not None and not self._reply.ok

    def describe(self) -> str:
        """``component.method on rank N (call #id)`` for messages."""
        return f"{self.component}.{self.method} on rank {self.rank} (call #{self.call_id})"

    def result(self, timeout: float | None = None) -> Any:
        """The method's return value; raises `WorkerError` if it raised on the worker.

        ``timeout`` defaults to the job's ``call_timeout_s``; on expiry `CommTimeoutError`
        names the rank and method that did not answer.
        """
        if self._reply is None:
            self._wait(self, timeout)
        reply = self._reply
        assert reply is not None
        if not reply.ok:
            raise WorkerError(reply.rank, reply.component, self.method, reply.error, reply.traceback)
        return reply.value


class GroupFuture:
    """Futures for the same call on several ranks of a group, in group-rank order."""

    def __init__(self, futures: list[CallFuture]) -> None:
        self.futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def result(self, timeout: float | None = None) -> list[Any]:
        """Every rank's return value in group-rank order; the first failure raises.

        ``timeout`` bounds the whole wait, not each rank's.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        results = []
        for future in self.futures:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            results.append(future.result(remaining))
        return results

    def __len__(self) -> int:
        return len(self.futures)

    def __getitem__(self, index: int) -> CallFuture:
        return self.futures[index]
