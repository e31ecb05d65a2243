"""Waiting without spinning: exponential back-off sleeps and deadline-aware polling.

MPICH's blocking calls busy-poll a core; with 4 ranks on 2 cores that halves everyone's speed.
Every wait in rlinf_hpc polls a non-blocking test and sleeps between polls, starting short (low
latency when the answer is near) and growing to a cap (near-zero CPU when idle).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from rlinf_hpc.errors import CommTimeoutError, UserError

T = TypeVar("T")

#: First sleep after an unsuccessful poll, seconds.
INITIAL_SLEEP_S = 20e-6
#: Longest sleep between polls while recently active, seconds.
MAX_SLEEP_S = 2e-3
#: After this long without success the rank counts as idle...
IDLE_AFTER_S = 1.0
#: ...and sleeps up to this long between polls (100 wake-ups/s: well under 1% of a core).
IDLE_MAX_SLEEP_S = 10e-3


#: Timer slack the ranks' threads run with, nanoseconds (Linux's default is 50,000);
#: ``RLINF_HPC_TIMER_SLACK_NS`` overrides it (50000 restores the kernel's default).
PRECISE_TIMER_SLACK_NS = 1_000
TIMER_SLACK_VARIABLE = "RLINF_HPC_TIMER_SLACK_NS"
_PR_SET_TIMERSLACK = 29


def timer_slack_ns(environ: Mapping[str, str]) -> int:
    """The timer slack to run with: ``RLINF_HPC_TIMER_SLACK_NS`` if set, else 1 us.

    >>> timer_slack_ns({}), timer_slack_ns({"RLINF_HPC_TIMER_SLACK_NS": "50000"})
    (1000, 50000)
    """
    text = environ.get(TIMER_SLACK_VARIABLE, "").strip()
    if not text:
        return PRECISE_TIMER_SLACK_NS
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise UserError(
            f"{TIMER_SLACK_VARIABLE}={text!r} is not a positive whole number of nanoseconds: it sets how "
            "late the kernel may wake a rank from the sleeps between its polls. Unset it (1000, "
            "the default) or set 50000 for Linux's own default."
        )
    return value


def precise_sleeps(slack_ns: int = PRECISE_TIMER_SLACK_NS) -> bool:
    """Let this thread's sleeps end within ``slack_ns`` of when they were asked to (Linux's
    ``PR_SET_TIMERSLACK``; threads started after this inherit it). The kernel may otherwise
    defer a sleep's wake-up by up to 50 us to batch timers: measured on a 2-core box,
    ``time.sleep(20e-6)`` took 75 us at the median and 185 us at the 90th percentile, 25 / 26 us
    with a 1 us slack — and every wait in rlinf_hpc is such a sleep between polls (bench_comm:
    1 KB latency 20 -> 10-16 us, async 1 KB messages 47k -> 69-84k/s). Costs timer wake-ups no
    batching would have merged: idle waits back off to 2-10 ms sleeps, so a few hundred per
    second per rank at most. Returns False where it cannot be set (not Linux)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_TIMERSLACK, int(slack_ns), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class Backoff:
    """Sleep a little longer after each unsuccessful poll; `reset` after a success.

    The cap is ``maximum`` while the waiter was recently successful and ``idle_maximum`` once
    it has waited ``idle_after`` seconds in a row, so busy pipelines stay responsive while
    ranks parked for minutes cost next to nothing.

    With ``spin`` > 0 the first ``spin`` seconds after a reset only yield the core
    (``sched_yield``) between polls: a transfer in flight completes in microseconds and a
    sleep here costs ~90 us at least, while yielding still lets other ranks on the core run.

    >>> backoff = Backoff(initial=1e-6, maximum=4e-6)
    >>> [backoff.next_delay() for _ in range(4)]
    [1e-06, 2e-06, 4e-06, 4e-06]
    """

    def __init__(
        self,
        initial: float = INITIAL_SLEEP_S,
        maximum: float = MAX_SLEEP_S,
        idle_after: float = IDLE_AFTER_S,
        idle_maximum: float = IDLE_MAX_SLEEP_S,
        spin: float = 0.0,
    ) -> None:
        self.spin = spin
        self.initial = initial
        self.maximum = maximum
        self.idle_after = idle_after
        self.idle_maximum = max(idle_maximum, maximum)
        self._delay = initial
        self._since = time.monotonic()

    def next_delay(self) -> float:
        delay = self._delay
        idle = time.monotonic() - self._since >= self.idle_after
        self._delay = min(self._delay * 2, self.idle_maximum if idle else self.maximum)
        return delay

    def sleep(self) -> None:
        if self.spin and time.monotonic() - self._since < self.spin:
            os.sched_yield()
            return
        time.sleep(self.next_delay())

    def reset(self) -> None:
        self._delay = self.initial
        self._since = time.monotonic()


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


#: What this process's main thread waits on, outermost first (a collective, then the receive
#: inside it); the heartbeat thread reads it, so that the watchdog can tell a stuck wait from a
#: long one and name the ranks missing from the operation.
_WAITS: list[dict[str, Any]] = []


@contextmanager
def waiting_on(op: str, peers: Sequence[int]) -> Iterator[None]:
    """Record that the main thread waits in ``op`` for world ranks ``peers`` (other threads'
    waits are not recorded: the heartbeat reports the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    entry = {"op": op, "peers": [int(p) for p in peers], "since": time.time()}
    _WAITS.append(entry)
    try:
        yield
    finally:
        _WAITS.remove(entry)


def current_wait() -> dict[str, Any] | None:
    """The outermost wait of the main thread (op, its peers, since) and the innermost one's
    peers (``waiting_for``), or None.

    >>> with waiting_on("broadcast #1 over ranks [1, 2, 3]", [1, 2, 3]):
    ...     with waiting_on("receive from rank 1", [1]):
    ...         wait = current_wait()
    >>> wait["op"], wait["peers"], wait["waiting_for"], current_wait()
    ('broadcast #1 over ranks [1, 2, 3]', [1, 2, 3], [1], None)
    """
    waits = list(_WAITS)
    if not waits:
        return None
    outer, inner = waits[0], waits[-1]
    return {**outer, "waiting_for": inner["peers"], "inner_op": inner["op"]}
