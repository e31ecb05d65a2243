"""Profile a running job's component from outside (`rlinf-hpc profile RUN_DIR --component NAME`).

The ranks serving the component are found through their heartbeats (pid, host, components).
Each is sampled by py-spy for ``duration`` seconds without pausing it (``--nonblocking``), idle
threads included (a rank waiting on a transfer is the point), as a Chrome trace of its stacks.
From the samples of every rank's main thread:

- **hot functions**: self time (the leaf frame) and total time (anywhere on the stack);
- **communication share**: the part of the sampled time with a frame of rlinf_hpc's
  communication layer, mpi4py or torch.distributed on the stack;

and from the ``pipeline_step`` events written while sampling, each stage's **bubble**: the
share of its ranks' step time spent waiting on its upstream (``wait_s / (busy_s + wait_s)``).

>>> events = [
...     {"ph": "B", "name": "serve", "tid": 1, "ts": 0, "args": {"filename": "/x/service.py", "line": 1}},
...     {"ph": "B", "name": "wait", "tid": 1, "ts": 100,
...      "args": {"filename": "/x/rlinf_hpc/comm/waiting.py", "line": 9}},
...     {"ph": "E", "name": "wait", "tid": 1, "ts": 400},
...     {"ph": "E", "name": "serve", "tid": 1, "ts": 500},
... ]
>>> stats = analyse_trace(events)
>>> stats["comm_share"], [(h["function"], h["self_s"]) for h in stats["hot"]]
(0.6, [('wait', 0.0003), ('serve', 0.0002)])
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

COMM_MARKERS = ("/rlinf_hpc/comm/", "/rlinf_hpc/channel/", "/mpi4py/", "/torch/distributed/")


def find_py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def record(pids: dict[int, int], duration: float, rate: int, out_dir: Path) -> dict[int, dict[str, Any]]:
    """Sample every ``rank -> pid`` at once; each rank's trace events, or its error."""
    spy = find_py_spy()
    assert spy is not None
    procs = {}
    for rank, pid in pids.items():
        path = out_dir / f"py-spy-rank-{rank}.json"
        command = [spy, "record", "--pid", str(pid), "--duration", str(int(max(duration, 1))), "--rate",
                   str(rate), "--format", "chrometrace", "--idle", "--full-filenames", "--nonblocking",
                   "--output", str(path)]  # fmt: skip
        procs[rank] = (
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
            path,
        )
    results: dict[int, dict[str, Any]] = {}
    for rank, (proc, path) in procs.items():
        try:
            out, _ = proc.communicate(timeout=duration + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out = "py-spy did not finish"
        if proc.returncode == 0 and path.exists():
            results[rank] = {"events": json.loads(path.read_text(encoding="utf-8"))}
        else:
            results[rank] = {"error": (out or "").strip().splitlines()[-1:] or ["py-spy failed"]}
    return results


def _is_comm(filename: str) -> bool:
    return any(marker in filename for marker in COMM_MARKERS)


def analyse_trace(events: list[dict[str, Any]], top: int = 15) -> dict[str, Any]:
    """Hot functions and the communication share of one rank's main thread (py-spy's B/E events)."""
    by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        if event.get("ph") in ("B", "E"):
            by_thread[event.get("tid")].append(event)
    if not by_thread:
        return {"sampled_s": 0.0, "comm_share": None, "hot": []}
    # the main thread: not started by threading (the heartbeat, the watchdog); the busiest if several
    own = [tid for tid, evs in by_thread.items() if "_bootstrap" not in str(evs[0].get("name"))]
    main = max(own or by_thread, key=lambda tid: len(by_thread[tid]))
    stack: list[tuple[str, str]] = []
    self_time: Counter[tuple[str, str]] = Counter()
    total_time: Counter[tuple[str, str]] = Counter()
    comm, sampled, last = 0.0, 0.0, None
    for event in sorted(by_thread[main], key=lambda e: e["ts"]):
        ts = float(event["ts"])
        if last is not None and stack:
            span = (ts - last) / 1e6
            sampled += span
            self_time[stack[-1]] += span
            for frame in set(stack):
                total_time[frame] += span
            if any(_is_comm(where) for _, where in stack):
                comm += span
        last = ts
        if event["ph"] == "B":
            args = event.get("args") or {}
            stack.append((str(event["name"]), f"{args.get('filename', '?')}:{args.get('line', '?')}"))
        elif stack:
            stack.pop()
    hot = [{"function": name, "where": where, "self_s": round(seconds, 6),
            "total_s": round(total_time[(name, where)], 6)}
           for (name, where), seconds in self_time.most_common(top) if seconds > 0]  # fmt: skip
    return {"sampled_s": sampled, "comm_share": comm / sampled if sampled else None, "hot": hot}


def stage_bubbles(events_path: Path, since: float, until: float) -> dict[str, dict[str, float]]:
    """Per stage (component.method) of the pipeline steps that ended in [since, until]: busy and
    waiting seconds summed, and the bubble share."""
    totals: dict[str, dict[str, float]] = {}
    try:
        lines = events_path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return totals
    for line in lines:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") != "pipeline_step" or not since <= float(event.get("time", 0)) <= until:
            continue
        for stage in event.get("stages", []):
            key = f"{stage['component']}.{stage['method']}"
            entry = totals.setdefault(key, {"steps": 0, "busy_s": 0.0, "wait_s": 0.0})
            entry["steps"] += 1
            entry["busy_s"] += float(stage.get("busy_s", 0.0))
            entry["wait_s"] += float(stage.get("wait_s", 0.0))
    for entry in totals.values():
        spent = entry["busy_s"] + entry["wait_s"]
        entry["bubble"] = entry["wait_s"] / spent if spent else 0.0
    return totals


def merged_chrome_trace(results: dict[int, dict[str, Any]], component: str) -> dict[str, Any]:
    """Every rank's samples in one trace: a process per rank, named."""
    events: list[dict[str, Any]] = []
    for rank, result in sorted(results.items()):
        for event in result.get("events", []):
            events.append({**event, "pid": rank})
        events.append({"name": "process_name", "ph": "M", "pid": rank,
                       "args": {"name": f"rank {rank} ({component})"}})  # fmt: skip
    return {"traceEvents": events, "displayTimeUnit": "ms"}
