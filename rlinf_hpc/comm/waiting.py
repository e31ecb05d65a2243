"""Waiting without spinning: exponential back-off sleeps and deadline-aware polling.

MPICH's blocking calls busy-poll a core; with 4 ranks on 2 cores that halves everyone's speed.
Every wait in rlinf_hpc polls a non-blocking test and sleeps between polls, starting short (low
latency when the answer is near) and growing to a cap (near-zero CPU when idle).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from rlinf_hpc.errors import CommTimeoutError

T = TypeVar("T")

#: First sleep after an unsuccessful poll, seconds.
INITIAL_SLEEP_S = 20e-6
#: Longest sleep between polls, seconds. Bounds the added latency of an idle rank's wake-up.
MAX_SLEEP_S = 2e-3


class Backoff:
    """Sleep a little longer after each unsuccessful poll; `reset` after a success.

    >>> backoff = Backoff(initial=1e-6, maximum=4e-6)
    >>> [backoff.next_delay() for _ in range(4)]
    [1e-06, 2e-06, 4e-06, 4e-06]
    """

    def __init__(self, initial: float = INITIAL_SLEEP_S, maximum: float = MAX_SLEEP_S) -> None:
        self.initial = initial
        self.maximum = maximum
        self._delay = initial

    def next_delay(self) -> float:
        delay = self._delay
        self._delay = min(self._delay * 2, self.maximum)
        return delay

    def sleep(self) -> None:
        time.sleep(self.next_delay())

    def reset(self) -> None:
        self._delay = self.initial


def poll_until(
    poll: Callable[[], T | None],
    timeout: float | None,
    describe: Callable[[], str],
    backoff: Backoff | None = None,
) -> T:
    """Call ``poll`` until it returns something other than None, sleeping between calls.

    On timeout raises `CommTimeoutError` with ``describe()`` (who waited for whom, on what)
    and how long it waited.
    """
    backoff = backoff or Backoff()
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    while True:
        result = poll()
        if result is not None:
            return result
        if deadline is not None and time.monotonic() >= deadline:
            waited = time.monotonic() - start
            raise CommTimeoutError(f"{describe()}: no answer after {waited:.1f} s")
        backoff.sleep()
