"""Where a thread's wall time went on a shared CPU: on a core, or runnable and waiting for one.

Linux keeps both per thread in ``/proc/thread-self/schedstat`` (nanoseconds on a CPU, nanoseconds
waiting on a run queue, time slices). A stage's busy time on a rank is its CPU time, its wait
for a core (other ranks on the same cores: 4 worker ranks on this project's 2-core box wait
about as long as they compute) and whatever it spent blocked or sleeping (an emulated device's
sleep, a transfer). The run-queue wait is what contention added: ``auto``'s cost model takes it
out of what the warm-up measured and puts back what the placement it predicts will cost
(`scheduler.contention`). No library reads it (psutil has the CPU time, not the wait).

>>> clock = CpuClock()
>>> lap = clock.lap()
>>> sum(range(10_000)) > 0
True
>>> cpu, runqueue = clock.since(lap)
>>> cpu >= 0.0 and runqueue >= 0.0
True
"""

from __future__ import annotations

_PATH = "/proc/thread-self/schedstat"


def _read() -> tuple[float, float] | None:
    try:
        with open(_PATH) as f:
            fields = f.read().split()
        return int(fields[0]) / 1e9, int(fields[1]) / 1e9
    except (OSError, ValueError, IndexError):  # not Linux, or a kernel without schedstats
        return None


class CpuClock:
    """CPU and run-queue seconds of the calling thread between a `lap` and `since`. Without
    schedstats (not Linux, or a kernel built without them) both read 0: the CPU time alone,
    without the wait beside it, would tell the cost model a contended rank's time was its own."""

    def __init__(self) -> None:
        self.available = _read() is not None

    def lap(self) -> tuple[float, float]:
        return (_read() or (0.0, 0.0)) if self.available else (0.0, 0.0)

    def since(self, lap: tuple[float, float]) -> tuple[float, float]:
        """(CPU seconds, run-queue seconds) since ``lap``."""
        now = self.lap()
        return max(0.0, now[0] - lap[0]), max(0.0, now[1] - lap[1])
