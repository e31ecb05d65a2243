"""Spans of every rank's work (commands, transfers, switches), and their export.

Each rank records spans in its own `Timeline`; workers hand theirs to the coordinator when they
leave, and the coordinator writes them all to ``RUN_DIR/timeline.jsonl``. ``rlinf-hpc trace
RUN_DIR`` turns that into a Chrome trace (``trace.json``: open it in Perfetto or
chrome://tracing; one process per rank, one thread per component) and a Gantt chart PNG.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class Timeline:
    """This rank's spans: (name, category, lane, start, end, args), wall-clock seconds."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._spans: list[dict[str, Any]] = []

    def add(self, name: str, category: str, lane: str, start: float, end: float, **args: Any) -> None:
        self._spans.append(
            {
                "name": name,
                "cat": category,
                "rank": self.rank,
                "lane": lane,
                "start": start,
                "end": end,
                "args": args,
            }
        )

    @contextmanager
    def span(self, name: str, category: str, lane: str, **args: Any) -> Iterator[None]:
        """Record the ``with`` block as a span."""
        start = time.time()
        try:
            yield
        finally:
            self.add(name, category, lane, start, time.time(), **args)

    def drain(self) -> list[dict[str, Any]]:
        """The spans so far (and forget them)."""
        spans, self._spans = self._spans, []
        return spans


def write_spans(spans: list[dict[str, Any]], path: Path) -> None:
    """One JSON object per line."""
    with path.open("w", encoding="utf-8") as out:
        for span in sorted(spans, key=lambda s: (s["start"], s["rank"])):
            out.write(json.dumps(span, default=str) + "\n")


def read_spans(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def chrome_trace(spans: list[dict[str, Any]]) -> dict[str, Any]:
    """Chrome trace-event JSON: complete ("X") events, microseconds from the first span."""
    origin = min((s["start"] for s in spans), default=0.0)
    lanes: dict[tuple[int, str], int] = {}
    events: list[dict[str, Any]] = []
    for span in spans:
        tid = lanes.setdefault((span["rank"], span["lane"]), len(lanes) + 1)
        events.append(
            {
                "name": span["name"],
                "cat": span["cat"],
                "ph": "X",
                "pid": span["rank"],
                "tid": tid,
                "ts": (span["start"] - origin) * 1e6,
                "dur": max(span["end"] - span["start"], 0.0) * 1e6,
                "args": span["args"],
            }
        )
    for rank in sorted({r for r, _ in lanes}):
        label = "rank 0 (coordinator)" if rank == 0 else f"rank {rank}"
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": label}})
    for (rank, lane), tid in lanes.items():
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def gantt_png(spans: list[dict[str, Any]], path: Path) -> None:
    """One row per (rank, component), one bar per span, coloured by category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = min((s["start"] for s in spans), default=0.0)
    rows = sorted({(s["rank"], s["lane"]) for s in spans})
    categories = sorted({s["cat"] for s in spans})
    colours = {c: plt.cm.tab10(i % 10) for i, c in enumerate(categories)}
    figure, axes = plt.subplots(figsize=(12, 1.0 + 0.45 * max(len(rows), 1)))
    for index, row in enumerate(rows):
        bars = [
            (s["start"] - origin, max(s["end"] - s["start"], 1e-4), s["cat"])
            for s in spans
            if (s["rank"], s["lane"]) == row
        ]
        for start, width, category in bars:
            axes.broken_barh([(start, width)], (index - 0.4, 0.8), color=colours[category])
    axes.set_yticks(range(len(rows)), [f"r{rank} {lane}" for rank, lane in rows])
    axes.set_xlabel("seconds since the first span")
    axes.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[c]) for c in categories]
    axes.legend(handles, categories, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
