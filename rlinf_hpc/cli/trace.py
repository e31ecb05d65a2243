"""`rlinf-hpc trace RUN_DIR [--steps A-B]`: a run's timeline as a Chrome trace and a Gantt PNG.

The whole run of a long job is a solid block of colour at any width, so ``--steps A-B`` keeps
the spans that overlap pipeline steps A to B (from the ``pipeline_step`` events: a step is the
time from its first stage's start to its end, over every pipeline with that step), clips them
to that window, and adds a ``steps`` lane with one bar per step.

>>> parse_steps("3-5"), parse_steps("7")
((3, 5), (7, 7))
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rlinf_hpc.errors import UserError


def add_parser(commands: Any, common: argparse.ArgumentParser) -> None:
    trace = commands.add_parser(
        "trace",
        parents=[common],
        help="turn a run's timeline into a Chrome trace and a Gantt PNG",
        description="Reads RUN_DIR/timeline.jsonl (written by `run --run-dir`) and writes "
        "trace.json (open in Perfetto or chrome://tracing) and timeline.png; with --steps A-B, "
        "only those pipeline steps (trace-steps-A-B.json, timeline-steps-A-B.png).",
    )
    trace.add_argument("run_dir", help="the --run-dir of a finished run")
    trace.add_argument("--steps", metavar="A-B", help="zoom to pipeline steps A to B (or one step A)")
    trace.add_argument("--out", help="where to write (default: RUN_DIR)")


def parse_steps(text: str) -> tuple[int, int]:
    first, _, last = text.partition("-")
    try:
        a, b = int(first), int(last or first)
    except ValueError:
        raise UserError(
            f"trace --steps '{text}' is not a step range: give A-B (e.g. 10-12) or one step."
        ) from None
    if a < 0 or b < a:
        raise UserError(f"trace --steps '{text}': the range must be A-B with 0 <= A <= B.")
    return a, b


def step_windows(events_path: Path) -> dict[int, tuple[float, float]]:
    """Step -> (start, end) wall-clock seconds, over every pipeline's step of that number."""
    windows: dict[int, tuple[float, float]] = {}
    if not events_path.is_file():
        return windows
    for line in events_path.read_text(encoding="utf-8").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") != "pipeline_step":
            continue
        end = float(event["time"])
        start = end - float(event.get("seconds", 0.0))
        step = int(event["step"])
        old = windows.get(step)
        windows[step] = (min(start, old[0]), max(end, old[1])) if old else (start, end)
    return windows


def zoom(
    spans: list[dict[str, Any]], windows: dict[int, tuple[float, float]], a: int, b: int
) -> list[dict[str, Any]]:
    """The spans overlapping steps a..b, clipped, plus one ``steps``-lane bar per step."""
    chosen = {s: w for s, w in windows.items() if a <= s <= b}
    t0, t1 = min(w[0] for w in chosen.values()), max(w[1] for w in chosen.values())
    out = [{**s, "start": max(s["start"], t0), "end": min(s["end"], t1)} for s in spans
           if s["end"] > t0 and s["start"] < t1]  # fmt: skip
    out += [{"name": f"step {step}", "cat": "step", "rank": 0, "lane": "steps", "start": w[0], "end": w[1],
             "args": {"step": step}} for step, w in sorted(chosen.items())]  # fmt: skip
    return out


def run(args: argparse.Namespace) -> int:
    from rlinf_hpc.runtime.timeline import chrome_trace, gantt_png, read_spans

    source = Path(args.run_dir) / "timeline.jsonl"
    if not source.is_file():
        raise UserError(
            f"'{source}' does not exist: pass the --run-dir of a run that finished (runs write "
            "timeline.jsonl there when they end), e.g. `rlinf-hpc run CONFIG --run-dir runs/a` "
            "then `rlinf-hpc trace runs/a`."
        )
    try:
        spans = read_spans(source)
    except (json.JSONDecodeError, KeyError) as exc:
        raise UserError(f"'{source}' is not a timeline written by rlinf-hpc ({exc}).") from None
    suffix = ""
    if args.steps:
        a, b = parse_steps(args.steps)
        windows = step_windows(Path(args.run_dir) / "events.jsonl")
        if not any(a <= s <= b for s in windows):
            known = f"{min(windows)}-{max(windows)}" if windows else "none (no pipeline_step events)"
            raise UserError(
                f"trace --steps {args.steps}: the run has no such pipeline step; its steps are {known}."
            )
        spans = zoom(spans, windows, a, b)
        suffix = f"-steps-{a}-{b}"
    out = Path(args.out or args.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    trace_path, png_path = out / f"trace{suffix}.json", out / f"timeline{suffix}.png"
    trace_path.write_text(json.dumps(chrome_trace(spans)), encoding="utf-8")
    gantt_png(spans, png_path)
    sys.stdout.write(f"{len(spans)} spans -> {trace_path} (Perfetto) and {png_path}\n")
    return 0
