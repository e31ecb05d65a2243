"""Non-spinning waits: back-off growth, the idle tier, and timeout messages."""

from __future__ import annotations

import time

import pytest

from rlinf_hpc.comm import Backoff, poll_until
from rlinf_hpc.errors import CommTimeoutError


def test_backoff_doubles_to_cap_then_rises_to_idle_cap_after_idle_time() -> None:
    backoff = Backoff(initial=1e-4, maximum=4e-4, idle_after=0.05, idle_maximum=1.6e-3)
    assert [backoff.next_delay() for _ in range(4)] == [1e-4, 2e-4, 4e-4, 4e-4]
    time.sleep(0.06)
    delays = [backoff.next_delay() for _ in range(4)]
    assert delays == [4e-4, 8e-4, 1.6e-3, 1.6e-3]
    backoff.reset()
    assert backoff.next_delay() == 1e-4


def test_poll_until_returns_first_non_none() -> None:
    values = iter([None, None, 0, 5])
    assert poll_until(lambda: next(values), timeout=5, describe=lambda: "x") == 0


def test_poll_until_timeout_names_the_wait() -> None:
    start = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"rank 3 waited for rank 1 on recv: no answer after 0\.2 s"):
        poll_until(lambda: None, timeout=0.2, describe=lambda: "rank 3 waited for rank 1 on recv")
    assert 0.2 <= time.monotonic() - start < 1.0


def test_poll_until_sleeps_instead_of_spinning() -> None:
    calls = 0

    def poll() -> None:
        nonlocal calls
        calls += 1

    cpu = time.process_time()
    with pytest.raises(CommTimeoutError):
        poll_until(poll, timeout=0.5, describe=lambda: "idle")
    # A spinning loop would make ~10^5+ calls and burn the whole 0.5 s of CPU.
    assert calls < 1000
    assert time.process_time() - cpu < 0.2
