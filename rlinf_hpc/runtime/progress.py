"""Progress of a long phase (an evaluation, a warm start, a rollout): ``done/total`` and a rate
on the console at most every ``every_s`` seconds, and in the rank's heartbeat for
``rlinf-hpc monitor``.

>>> progress = Progress("evaluate", total=64, unit="problems", every_s=1e9)
>>> progress.advance(16, tokens=800)
>>> current_progress().startswith("evaluate 16/64 problems")
True
>>> progress.close(); current_progress()
''
"""

from __future__ import annotations

import threading
import time

from rlinf_hpc.log import get_logger

log = get_logger("progress")

_lock = threading.Lock()
_current = ""


def current_progress() -> str:
    """This process's phase in progress (``""`` when none): the heartbeat thread reads it."""
    with _lock:
        return _current


def _publish(text: str) -> None:
    global _current
    with _lock:
        _current = text


class Progress:
    """One phase's counter: `advance` after each piece of work, `close` at its end (logs the
    final line when the phase logged any before)."""

    def __init__(self, what: str, total: int, unit: str, every_s: float = 10.0) -> None:
        self.what, self.total, self.unit, self.every_s = what, total, unit, every_s
        self.done = 0
        self.tokens = 0
        self.started = self._last_log = time.monotonic()
        self._logged = False
        _publish(self.line())

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = f", {self.tokens / elapsed:.0f} tok/s" if self.tokens else ""
        return f"{self.what} {self.done}/{self.total} {self.unit}{rate}, {elapsed:.0f} s"

    def advance(self, count: int, tokens: int = 0) -> None:
        self.done += count
        self.tokens += tokens
        _publish(self.line())
        now = time.monotonic()
        if now - self._last_log >= self.every_s:
            log.info("%s", self.line())
            self._last_log, self._logged = now, True

    def close(self) -> None:
        if self._logged:
            log.info("%s (done)", self.line())
        _publish("")
