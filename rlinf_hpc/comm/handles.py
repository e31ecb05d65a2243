"""Work handles returned by asynchronous sends and receives (`wait(timeout)`, `done()`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlinf_hpc.comm.waiting import poll_until

_NOTHING = object()


class WorkHandle:
    """An operation in flight. ``done()`` tests without blocking; ``wait`` blocks (sleeping
    between tests) and returns the result — the received object for receives, None for sends.
    """

    def __init__(
        self,
        test: Callable[[], bool],
        result: Callable[[], Any],
        describe: Callable[[], str],
        before_wait: Callable[[], None] | None = None,
    ) -> None:
        self._test = test
        self._result = result
        self._describe = describe
        self._before_wait = before_wait
        self._value: Any = _NOTHING

    def done(self) -> bool:
        if self._value is not _NOTHING:
            return True
        if self._before_wait is not None:
            self._before_wait()
        if self._test():
            self._value = self._result()
            return True
        return False

    def wait(self, timeout: float | None = None) -> Any:
        """Block until complete; `CommTimeoutError` names who waited for whom on what."""
        if self._value is _NOTHING:
            poll_until(lambda: True if self.done() else None, timeout, self._describe)
        return self._value

    def __repr__(self) -> str:
        state = "done" if self._value is not _NOTHING else "pending"
        return f"<WorkHandle {self._describe()} {state}>"


def wait_all(handles: list[WorkHandle], timeout: float | None = None) -> list[Any]:
    """Wait for every handle (one shared deadline); results in order."""
    import time

    deadline = None if timeout is None else time.monotonic() + timeout
    results = []
    for handle in handles:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        results.append(handle.wait(remaining))
    return results
