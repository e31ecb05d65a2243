"""`rlinf-hpc monitor RUN_DIR [--metric gpu_util,mem_usage,batch_size]`: a live view of a job.

Reads only what the job writes (heartbeats, events, metrics, summary), so it runs anywhere the
run directory is visible — a login node, a tmux pane — and costs the job nothing. One row per
rank: components, what it is doing and for how long, heartbeat age (``STALLED`` past three
beats), and the metrics asked for; below, the last step and the latest alarms. Refreshes every
``--interval`` seconds (rich's live view on a terminal, a plain frame per interval otherwise)
and exits when the job ends, printing its summary; on a finished run it prints the summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from rlinf_hpc.errors import UserError

#: --metric name -> (column title, how to read it from a heartbeat and the latest step)
METRICS = {
    "gpu_util": "GPU util %",
    "gpu_temp": "GPU °C",
    "gpu_mem": "GPU mem MB",
    "mem_usage": "RSS MB",
    "batch_size": "micro-batch",
}
_ALARMS = {"gpu_health", "memory_leak", "straggler", "nccl_warning", "end", "checkpoint", "placement"}


def add_parser(commands: Any, common: argparse.ArgumentParser) -> None:
    monitor = commands.add_parser(
        "monitor",
        parents=[common],
        help="live view of a running job from its run directory (ranks, activity, metrics)",
        description="Shows every rank of the job writing RUN_DIR: components, activity, heartbeat "
        "age, the chosen metrics, the last step and alarms; exits when the job ends.",
    )
    monitor.add_argument("run_dir", help="the --run-dir of a job (running or finished)")
    monitor.add_argument("--metric", default="mem_usage,batch_size",
                         help=f"comma-separated columns among {', '.join(METRICS)}")  # fmt: skip
    monitor.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    monitor.add_argument("--once", action="store_true", help="print one frame and exit")


def _metric_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METRICS]
    if unknown:
        raise UserError(f"monitor --metric: unknown {', '.join(unknown)}; choose among {', '.join(METRICS)}.")
    return names


class MonitorState:
    """What the view shows, updated from the run directory's files."""

    def __init__(self, view: Any) -> None:
        from rlinf_hpc.runtime.runview import JsonlTail

        self.view = view
        self.events = JsonlTail(view.path / "events.jsonl")
        self.metrics = JsonlTail(view.path / "metrics.jsonl")
        self.last_step: dict[str, Any] | None = None
        self.last_metrics: dict[str, Any] | None = None
        self.alarms: deque[str] = deque(maxlen=6)
        self.steps_seen: deque[float] = deque(maxlen=20)

    def update(self) -> None:
        for event in self.events.read():
            kind = event.get("event")
            if kind == "pipeline_step":
                self.last_step = event
                self.steps_seen.append(float(event.get("time", time.time())))
            elif kind in _ALARMS:
                stamp = time.strftime("%H:%M:%S", time.localtime(float(event.get("time", 0))))
                details = {
                    k: v for k, v in event.items() if k not in ("time", "rank", "event", "run_id", "stages")
                }
                self.alarms.append(f"{stamp} {kind}: {json.dumps(details, default=str)[:150]}")
        new = self.metrics.read()
        if new:
            self.last_metrics = new[-1]

    def batch_of(self, rank: int) -> str:
        for stage in (self.last_step or {}).get("stages", []):
            if rank in stage.get("ranks", []):
                return f"{stage.get('mean_micro_batch', 0):.1f}"
        return "-"

    def cell(self, metric: str, record: dict[str, Any]) -> str:
        gpu = record.get("gpu") or {}
        value = {
            "gpu_util": gpu.get("util_pct"),
            "gpu_temp": gpu.get("temp_c"),
            "gpu_mem": gpu.get("mem_used_mb", record.get("device_mb")),
            "mem_usage": record.get("rss_mb"),
        }.get(metric)
        if metric == "batch_size":
            return self.batch_of(int(record.get("rank", -1)))
        return "-" if value is None else f"{value:.0f}"


def render(state: MonitorState, metrics: list[str], now: float | None = None) -> Any:
    """One frame: a rich Group of the header, the rank table and the alarms."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    now = time.time() if now is None else now
    view = state.view
    summary = view.summary()
    beat = view.heartbeat_s()
    started = float(summary.get("started", now))
    header = (f"run {summary.get('run_id', '?')} in {view.path} | {summary.get('outcome', '?')} | "
              f"{now - started:.0f} s")  # fmt: skip
    if state.last_step:
        rate = ""
        if len(state.steps_seen) >= 2:
            span = state.steps_seen[-1] - state.steps_seen[0]
            rate = f", {(len(state.steps_seen) - 1) / span:.2f} steps/s" if span > 0 else ""
        header += (f" | pipeline {state.last_step.get('pipeline')} step {state.last_step.get('step')} "
                   f"({float(state.last_step.get('seconds', 0)):.2f} s{rate})")  # fmt: skip
    table = Table(title=header, title_justify="left")
    for column in [
        "rank",
        "host",
        "components",
        "doing",
        "for s",
        "beat age",
        *[METRICS[m] for m in metrics],
    ]:
        table.add_column(column)
    for record in view.heartbeats():
        age = now - float(record.get("time", now))
        if record.get("left"):
            status = "left"
        elif age > 3 * beat:
            status = f"STALLED {age:.0f} s"
        else:
            status = f"{age:.1f} s"
        busy = now - float(record.get("since", now))
        style = "bold red" if status.startswith("STALLED") else None
        table.add_row(str(record.get("rank")), str(record.get("host")), str(record.get("roles") or "-"),
                      _activity(record), f"{busy:.0f}", status,
                      *[state.cell(m, record) for m in metrics], style=style)  # fmt: skip
    parts: list[Any] = [table]
    if state.last_metrics:
        shown = {
            k: v
            for k, v in state.last_metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        parts.append(Text("metrics: " + ", ".join(f"{k}={v:.4g}" for k, v in list(shown.items())[:10])))
    parts.extend(Text(line) for line in state.alarms)
    return Group(*parts)


def _activity(record: dict[str, Any]) -> str:
    """What the rank does, with its phase's progress when it reports one."""
    activity = str(record.get("activity") or "-")
    return f"{activity} ({record['progress']})" if record.get("progress") else activity


def _brief(value: Any, width: int = 100) -> str:
    text = json.dumps(value, default=str) if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def print_summary(view: Any) -> None:
    from rlinf_hpc.runtime.console import print_table

    summary = view.summary()
    rows = [(k, _brief(v)) for k, v in summary.items()]
    print_table(f"run {view.path}: {summary.get('outcome', 'no summary')}", ["key", "value"], rows)


def run(args: argparse.Namespace) -> int:
    from rlinf_hpc.runtime.console import console
    from rlinf_hpc.runtime.runview import RunView

    metrics = _metric_names(args.metric)
    if args.interval <= 0:
        raise UserError("monitor --interval must be > 0 seconds.")
    view = RunView.open(Path(args.run_dir), "monitor")
    state = MonitorState(view)
    out = console()
    if not view.running():
        print_summary(view)
        return 0
    if args.once or not sys.stdout.isatty():
        while True:
            state.update()
            with out.capture() as capture:
                out.print(render(state, metrics))
            sys.stdout.write(capture.get())
            sys.stdout.flush()
            if args.once:
                return 0
            if not view.running():
                break
            time.sleep(args.interval)
    else:
        from rich.live import Live

        with Live(render(state, metrics), console=out, refresh_per_second=4, screen=False) as live:
            while view.running():
                state.update()
                live.update(render(state, metrics))
                time.sleep(args.interval)
    if view.summary().get("outcome") == "running":  # every heartbeat aged: killed outright
        sys.stdout.write("no rank of the job has beaten for a while, yet its summary says running: it was "
                         "killed without ending (see events.jsonl and the job's output)\n")  # fmt: skip
    else:
        sys.stdout.write("the job ended\n")
    print_summary(view)
    return 0
