"""Work handles returned by asynchronous sends and receives (`wait(timeout)`, `done()`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rlinf_hpc.comm.waiting import Backoff, waiting_on
from rlinf_hpc.errors import CommTimeoutError

#: How long any wait yields instead of sleeping (see `Backoff`).
TRANSFER_SPIN_S = 2e-3
#: A transfer in flight is given this throughput's worth of yielding on top (a slow,
#: page-faulting receiver of 64 MB still finishes inside it).
SPIN_BYTES_PER_S = 0.2e9

#: How long past its timeout a wait may go on for a message whose bytes are already landing.
ABANDON_GRACE_S = 10.0

_NOTHING = object()


class WorkHandle:
    """An operation in flight. ``done()`` tests without blocking; ``wait`` blocks and returns
    the result — the received object for receives, None for sends.

    ``finish`` (optional) is tried before each sleep in `wait` (never in `done`): it may block
    inside MPI when the operation's bytes are known to be moving, and returns True if it did.

    ``abandon`` (optional) runs when `wait` times out, before it raises: it withdraws the
    operation (a receive stops being posted, so the next message goes to the next receive) and
    returns False, or returns True when the operation is about to complete (its bytes are
    landing) and the wait should go on.

    Once complete, a handle drops its callables: they close over the handle itself and the
    received object, and such a cycle would keep every received buffer alive until Python's
    cycle collector runs.

    Waiting yields the core while a transfer is plausibly moving (`mark_active`: a few ms plus
    the time the bytes need at 1 GB/s), because MPI moves large shared-memory messages only
    while both sides poll; after that it backs off to sleeping so idle waits cost no CPU.
    """

    def __init__(
        self,
        test: Callable[[], bool],
        result: Callable[[], Any],
        describe: Callable[[], str],
        before_wait: Callable[[], None] | None = None,
        active_bytes: int = 0,
        finish: Callable[[], bool] | None = None,
        abandon: Callable[[], bool] | None = None,
    ) -> None:
        self._test: Callable[[], bool] | None = test
        self._result: Callable[[], Any] | None = result
        self._describe: Callable[[], str] | None = describe
        self._before_wait = before_wait
        self._value: Any = _NOTHING
        self._finish = finish
        self._abandon = abandon
        self._spin = TRANSFER_SPIN_S
        self._activated = False
        #: The world rank this handle waits for (receives), recorded while it waits (`waiting_on`).
        self.peer: int | None = None
        if active_bytes:
            self.mark_active(active_bytes)

    def mark_active(self, nbytes: int) -> None:
        """A transfer of ``nbytes`` for this handle is in flight: keep polling closely."""
        self._spin = TRANSFER_SPIN_S + nbytes / SPIN_BYTES_PER_S
        self._activated = True

    def done(self) -> bool:
        """True once complete (tests without blocking; flushes pending batches first)."""
        if self._value is not _NOTHING:
            return True
        assert self._test is not None and self._result is not None
        if self._test() or (self._before_wait is not None and self._run_before_wait()):
            result = self._result
            self._test = self._result = self._describe = None  # break the cycles (see above)
            self._before_wait = self._finish = self._abandon = None
            self._value = result()
            return True
        return False

    def _run_before_wait(self) -> bool:
        """Flush/poll (only when the first test failed: the fast path skips it), test again."""
        assert self._before_wait is not None and self._test is not None
        self._before_wait()
        return self._test()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until complete; `CommTimeoutError` names who waited for whom on what."""
        if self.done():
            return self._value
        if self.peer is None:
            return self._wait(timeout)
        assert self._describe is not None
        with waiting_on(self._describe(), [self.peer]):
            return self._wait(timeout)

    def _wait(self, timeout: float | None) -> Any:
        start = time.monotonic()
        backoff = Backoff(spin=self._spin)
        while not self.done():
            if self._finish is not None and self._finish():
                continue  # it waited inside MPI for bytes that were moving; test again
            if self._activated:  # the transfer started since the last poll: spin anew
                self._activated = False
                backoff.spin = self._spin
                backoff.reset()
            if timeout is not None and time.monotonic() - start >= timeout:
                # Its bytes are landing: finish instead of losing the message, within a grace.
                landing = self._abandon is not None and self._abandon()
                if landing and time.monotonic() - start < 2 * timeout + ABANDON_GRACE_S:
                    backoff.sleep()
                    continue
                assert self._describe is not None
                raise CommTimeoutError(
                    f"{self._describe()}: no answer after {time.monotonic() - start:.1f} s"
                )
            backoff.sleep()
        return self._value

    def __repr__(self) -> str:
        if self._value is not _NOTHING or self._describe is None:
            return "<WorkHandle done>"
        return f"<WorkHandle {self._describe()} pending>"


def wait_all(handles: list[WorkHandle], timeout: float | None = None) -> list[Any]:
    """Wait for every handle (one shared deadline); results in order."""
    deadline = None if timeout is None else time.monotonic() + timeout
    results = []
    for handle in handles:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        results.append(handle.wait(remaining))
    return results
