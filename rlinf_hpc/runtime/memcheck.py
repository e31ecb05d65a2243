"""Memory growth of a function called again and again (`rlinf-hpc diagnose memory`).

`measure_growth` calls ``step`` ``warmup + iterations`` times. After each call it records the
process's RSS (psutil), the Python heap that tracemalloc traces, and, where CUDA is up, the
device memory torch has allocated. Growth per iteration is the Theil–Sen slope over the
measured iterations (the warm-up fills caches once and is left out); the top allocation sites
are tracemalloc's diff between the snapshot after the warm-up and the one after the last call,
by source line — where a leak allocates. With CUDA, a memory snapshot (allocation history with
stacks, ``torch.cuda.memory._dump_snapshot``) is written next to the report when asked for.

>>> report = measure_growth(lambda: None, iterations=4, warmup=1)
>>> report.iterations, abs(report.python_kb_per_iter) < 5
(4, True)
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlinf_hpc.imports import loaded
from rlinf_hpc.runtime.leaks import theil_sen_slope


@dataclass
class GrowthReport:
    iterations: int
    seconds_per_iter: float
    rss_mb: list[float]
    python_mb: list[float]
    rss_mb_per_iter: float
    python_kb_per_iter: float
    device_mb: list[float] = field(default_factory=list)
    device_mb_per_iter: float | None = None
    top_sites: list[dict[str, Any]] = field(default_factory=list)
    cuda_snapshot: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _cuda() -> Any:
    torch = loaded("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch
    return None


def measure_growth(
    step: Callable[[], Any],
    iterations: int = 20,
    warmup: int = 2,
    top: int = 10,
    frames: int = 8,
    cuda_snapshot: Path | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> GrowthReport:
    """Call ``step`` ``warmup + iterations`` times and report how memory grew per call."""
    _rss_mb()  # psutil imported before the first snapshot: its import is no growth
    started_tracing = not tracemalloc.is_tracing()
    if started_tracing:
        tracemalloc.start(frames)
    torch = _cuda()
    if torch is not None and cuda_snapshot is not None:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        for _ in range(warmup):
            step()
        gc.collect()
        baseline = tracemalloc.take_snapshot()
        rss, python, device = [], [], []
        started = time.perf_counter()
        for index in range(iterations):
            step()
            gc.collect()  # what stays after a collection is what a leak keeps
            rss.append(_rss_mb())
            python.append(tracemalloc.get_traced_memory()[0] / 2**20)
            torch = torch or _cuda()
            if torch is not None:
                device.append(torch.cuda.memory_allocated() / 2**20)
            if progress is not None:
                progress(index + 1, rss[-1])
        seconds = (time.perf_counter() - started) / max(iterations, 1)
        final = tracemalloc.take_snapshot()
        snapshot_path = None
        if torch is not None and cuda_snapshot is not None:
            torch.cuda.memory._dump_snapshot(str(cuda_snapshot))
            snapshot_path = str(cuda_snapshot)
    finally:
        if started_tracing:
            tracemalloc.stop()
    xs = list(range(iterations))
    sites = []
    ignore = (tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__))
    diffs = final.filter_traces(ignore).compare_to(baseline.filter_traces(ignore), "lineno")
    for diff in [d for d in diffs if d.size_diff > 0][:top]:
        frame = diff.traceback[0]
        sites.append({"site": f"{frame.filename}:{frame.lineno}", "blocks": diff.count_diff,
                      "kb_per_iter": diff.size_diff / 1024 / iterations,
                      "total_kb": diff.size / 1024})  # fmt: skip
    return GrowthReport(
        iterations=iterations,
        seconds_per_iter=seconds,
        rss_mb=rss,
        python_mb=python,
        rss_mb_per_iter=theil_sen_slope(xs, rss),
        python_kb_per_iter=theil_sen_slope(xs, python) * 1024,
        device_mb=device,
        device_mb_per_iter=theil_sen_slope(xs, device) if device else None,
        top_sites=sites,
        cuda_snapshot=snapshot_path,
    )
