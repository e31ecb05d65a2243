"""Memory-leak detection: per-rank memory per step, a robust slope over a window, an alarm.

Every rank's heartbeat carries its host RSS (and CUDA memory in use where CUDA is up); after
each pipeline step the coordinator feeds the newest values to `LeakMonitor`. Over the last
``window`` steps it fits the Theil–Sen slope (the median of all pairwise slopes: one outlier —
a garbage collection, a cache filled once — does not move it) and raises an alarm for a rank
whose memory grows by more than ``min_mb_per_step`` per step *and* by at least
``min_growth_mb`` over the window (a slow, steady leak; warm-up growth is outside the window
once the job has run ``window`` steps). Actions: ``warn`` (once per rank, with its rate),
``free`` (every rank runs `Worker.free_memory`: gc and ``torch.cuda.empty_cache``, the seed's
fix for its render-buffer leak), ``checkpoint_stop`` (save and stop at the next step boundary,
as SIGUSR2 would).

>>> round(theil_sen_slope([0, 1, 2, 3, 4], [10, 12, 14, 100, 18]), 6)  # one outlier
2.0
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlinf_hpc.log import get_logger
from rlinf_hpc.runtime.signals import request_stop

log = get_logger("leaks")


def theil_sen_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Median of the slopes between every pair of points (0 for fewer than two)."""
    slopes = [
        (ys[j] - ys[i]) / (xs[j] - xs[i])
        for i in range(len(xs))
        for j in range(i + 1, len(xs))
        if xs[j] != xs[i]
    ]
    return statistics.median(slopes) if slopes else 0.0


@dataclass(frozen=True)
class LeakAlarm:
    rank: int
    kind: str  # "host" or "device"
    mb_per_step: float
    growth_mb: float
    steps: int

    def describe(self, who: str) -> str:
        return (
            f"{who}: {self.kind} memory grows {self.mb_per_step:.1f} MB/step "
            f"({self.growth_mb:.0f} MB over the last {self.steps} steps) — a leak?"
        )


class LeakMonitor:
    """``observe(step, {(rank, kind): megabytes})`` -> alarms of this step."""

    def __init__(self, window: int, min_mb_per_step: float, min_growth_mb: float) -> None:
        self.window = window
        self.min_mb_per_step = min_mb_per_step
        self.min_growth_mb = min_growth_mb
        self._series: dict[tuple[int, str], deque[tuple[int, float]]] = {}

    def observe(self, step: int, usage: dict[tuple[int, str], float]) -> list[LeakAlarm]:
        alarms = []
        for key, megabytes in usage.items():
            series = self._series.setdefault(key, deque(maxlen=self.window))
            series.append((step, megabytes))
            if len(series) < self.window:
                continue
            slope = theil_sen_slope([s for s, _ in series], [m for _, m in series])
            growth = slope * (series[-1][0] - series[0][0])
            if slope > self.min_mb_per_step and growth >= self.min_growth_mb:
                alarms.append(LeakAlarm(key[0], key[1], slope, growth, len(series)))
        return alarms


def make_step_hook(
    monitor: LeakMonitor,
    read_usage: Callable[[], dict[tuple[int, str], float]],
    describe_rank: Callable[[int], str],
    action: str,
    release_caches: Callable[[], None],
    record: Callable[..., None],
) -> Callable[[str, Any], None]:
    """The coordinator's after-step hook: observe, and act on alarms (once per rank and kind
    for ``warn``; ``free`` and ``checkpoint_stop`` act on every alarm, at most once a window)."""
    warned: set[tuple[int, str]] = set()
    acted_at: dict[tuple[int, str], int] = {}

    def after_step(pipeline: str, result: Any) -> None:
        step = result.step
        for alarm in monitor.observe(step, read_usage()):
            key = (alarm.rank, alarm.kind)
            if action == "warn" and key in warned:
                continue
            if action != "warn" and step - acted_at.get(key, -monitor.window) < monitor.window:
                continue
            warned.add(key)
            acted_at[key] = step
            log.warning(
                "%s (pipeline %s, step %d; action %s)",
                alarm.describe(describe_rank(alarm.rank)),
                pipeline,
                step,
                action,
            )
            rate, growth = round(alarm.mb_per_step, 3), round(alarm.growth_mb, 1)
            record("memory_leak", pipeline=pipeline, step=step, rank=alarm.rank, kind=alarm.kind,
                   mb_per_step=rate, growth_mb=growth, action=action)  # fmt: skip
            if action == "free":
                release_caches()
            elif action == "checkpoint_stop":
                request_stop(f"memory leak on rank {alarm.rank} ({alarm.mb_per_step:.1f} MB/step)")

    return after_step
