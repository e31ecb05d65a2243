"""What every benchmark in tools/ does alike: check its ratios against their bounds, and write
its JSON (``{"ratios": ..., "raw": ...}``) for ``--json PATH``."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

#: One panel of `plot_curves`: (x label, y label, {curve label: (xs, ys)}).
Panel = tuple[str, str, Mapping[str, tuple[list[float], list[float]]]]


def check_ratios(
    ratios: Mapping[str, float],
    required: Mapping[str, tuple[str, float]],
    not_yet_met: Collection[str] = (),
    digits: int = 2,
) -> tuple[list[tuple[str, str, str, str]], bool]:
    """Table rows ``(ratio, value, required, status)`` and whether the run passes: a ratio in
    ``not_yet_met`` that misses its bound is reported as "not met yet" and does not fail it."""
    rows, ok = [], True
    for name, value in ratios.items():
        op, bound = required[name]
        passed = value >= bound if op == ">=" else value <= bound
        status = "pass" if passed else ("not met yet" if name in not_yet_met else "FAIL")
        ok &= passed or name in not_yet_met
        rows.append((name, f"{value:.{digits}f}", f"{op} {bound}", status))
    return rows, ok


def write_json(path: str | None, result: Mapping[str, Any]) -> None:
    """Write ``result`` to ``path`` (``--json``), if one was given."""
    if path:
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")


def median_time(action: Callable[[], object], repeats: int = 5, warmup: bool = True) -> float:
    """Median wall seconds of ``repeats`` calls of ``action``, after one untimed call if
    ``warmup`` (first touch of buffers, lazy initialization)."""
    if warmup:
        action()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def curves_path(png: str | None, json_path: str | None, fallback: str) -> Path:
    """Where a bench draws its curves: ``--png``, else beside ``--json`` (``<stem>_curves.png``),
    else ``fallback`` in the current directory.

    >>> str(curves_path(None, "out/bench.json", "x.png")), str(curves_path(None, None, "x.png"))
    ('out/bench_curves.png', 'x.png')
    """
    if png:
        return Path(png)
    if json_path:
        return Path(json_path).with_name(Path(json_path).stem + "_curves.png")
    return Path(fallback)


def plot_curves(path: str | Path, title: str, panels: list[Panel], log2_x: bool = False) -> None:
    """Line plots side by side, one per panel, written as a PNG (headless: Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.3), squeeze=False)
    for ax, (xlabel, ylabel, curves) in zip(axes[0], panels, strict=True):
        for label, (xs, ys) in curves.items():
            if xs:
                ax.plot(xs, ys, marker="o", markersize=3, label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if log2_x:
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
