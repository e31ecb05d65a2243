"""`rlinf-hpc profile RUN_DIR --component NAME --duration S`: sample a running job's component.

Every rank of the component on this node is sampled at once by py-spy (`runtime.profiling`);
the report gives each rank's hot functions and communication share, and every stage's bubble
over the steps that ended while sampling. Writes ``profile.json`` and ``profile_trace.json`` (a
Chrome trace of the samples, a process per rank: Perfetto or chrome://tracing) under ``--out``
(default RUN_DIR/profile-<time>). Ranks on other nodes are listed; run the command there.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

from rlinf_hpc.errors import UserError


def add_parser(commands: Any, common: argparse.ArgumentParser) -> None:
    profile = commands.add_parser(
        "profile",
        parents=[common],
        help="sample a running job's component: hot functions, communication share, bubbles",
        description="Samples the ranks of COMPONENT of the job running in RUN_DIR with py-spy (the "
        "processes keep running) and reports hot functions, the communication share and each "
        "stage's pipeline bubble; text, JSON and a Chrome trace.",
    )
    profile.add_argument("run_dir", help="the --run-dir of a running job")
    profile.add_argument("--component", required=True, help="the component to sample (e.g. actor)")
    profile.add_argument("--duration", type=float, default=60.0, help="seconds to sample (default 60)")
    profile.add_argument("--rate", type=int, default=100, help="samples per second (default 100)")
    profile.add_argument("--top", type=int, default=15, help="hot functions per rank (default 15)")
    profile.add_argument("--out", help="output directory (default RUN_DIR/profile-HHMMSS)")


def run(args: argparse.Namespace) -> int:
    from rlinf_hpc.runtime.console import print_table
    from rlinf_hpc.runtime.profiling import (
        analyse_trace,
        find_py_spy,
        merged_chrome_trace,
        record,
        stage_bubbles,
    )
    from rlinf_hpc.runtime.runview import RunView

    if args.duration <= 0 or args.rate < 1 or args.top < 1:
        raise UserError("profile: --duration must be > 0, --rate and --top >= 1.")
    view = RunView.open(Path(args.run_dir), "profile")
    if not view.running():
        raise UserError(
            f"profile: the job of '{args.run_dir}' is not running (summary outcome "
            f"'{view.summary().get('outcome', '?')}'): profile samples live ranks. For a finished run "
            f"see `rlinf-hpc trace {args.run_dir}`."
        )
    ranks = view.ranks_of(args.component)
    if not ranks:
        raise UserError(
            f"profile: no live rank serves component '{args.component}' in '{args.run_dir}'; its "
            f"components are {', '.join(view.components()) or 'none yet'}."
        )
    spy = find_py_spy()
    if spy is None:
        raise UserError(
            "profile needs py-spy (`pip install py-spy`), which samples Python processes from outside."
        )
    host = socket.gethostname()
    local = {int(r["rank"]): int(r["pid"]) for r in ranks if r.get("host") == host}
    elsewhere = sorted(int(r["rank"]) for r in ranks if r.get("host") != host)
    if not local:
        hosts = sorted({str(r.get("host")) for r in ranks})
        raise UserError(
            f"profile: the ranks of '{args.component}' run on {', '.join(hosts)}, not on this node "
            f"({host}); run the command there (e.g. `srun --overlap -w HOST rlinf-hpc profile ...`)."
        )
    out = Path(args.out) if args.out else view.path / f"profile-{time.strftime('%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    sys.stdout.write(f"[profile] sampling {args.component} ranks {sorted(local)} for {args.duration:g} s "
                     f"at {args.rate}/s with py-spy (the job keeps running)\n")  # fmt: skip
    sys.stdout.flush()
    since = time.time()
    results = record(local, args.duration, args.rate, out)
    bubbles = stage_bubbles(view.path / "events.jsonl", since, time.time())
    report: dict[str, Any] = {
        "component": args.component, "duration_s": args.duration, "rate": args.rate,
        "ranks": {}, "stages": bubbles, "not_sampled_other_nodes": elsewhere,
    }  # fmt: skip
    for rank, result in sorted(results.items()):
        if "error" in result:
            report["ranks"][rank] = {"error": " ".join(result["error"])}
            sys.stdout.write(f"rank {rank}: py-spy failed: {report['ranks'][rank]['error']}\n")
            continue
        stats = analyse_trace(result["events"], args.top)
        report["ranks"][rank] = stats
        share = "-" if stats["comm_share"] is None else f"{100 * stats['comm_share']:.1f}%"
        rows = [
            (h["function"], _short(h["where"]), f"{h['self_s']:.3f}", f"{h['total_s']:.3f}")
            for h in stats["hot"]
        ]
        title = f"rank {rank} ({args.component}): {stats['sampled_s']:.1f} s sampled, communication {share}"
        print_table(title, ["function", "where", "self s", "total s"], rows)
    if bubbles:
        rows = [(stage, str(int(v["steps"])), f"{v['busy_s']:.2f}", f"{v['wait_s']:.2f}",
                 f"{100 * v['bubble']:.1f}%") for stage, v in sorted(bubbles.items())]  # fmt: skip
        print_table("pipeline stages over the steps that ended while sampling",
                    ["stage", "steps", "busy s", "waiting s", "bubble"], rows)  # fmt: skip
    else:
        sys.stdout.write("no pipeline step ended while sampling: no bubble figures (sample longer)\n")
    if elsewhere:
        sys.stdout.write(f"not sampled (other nodes): ranks {elsewhere}\n")
    (out / "profile.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    trace = merged_chrome_trace(results, args.component)
    (out / "profile_trace.json").write_text(json.dumps(trace), encoding="utf-8")
    for rank in results:
        (out / f"py-spy-rank-{rank}.json").unlink(missing_ok=True)  # merged into profile_trace.json
    sys.stdout.write(f"report: {out / 'profile.json'}, Chrome trace: {out / 'profile_trace.json'}\n")
    return 0 if any("error" not in r for r in report["ranks"].values()) else 1


def _short(where: str) -> str:
    """``.../site-packages/pkg/mod.py:12`` -> ``pkg/mod.py:12``."""
    for marker in ("/site-packages/", "/rlinf_hpc/", "/lib/python"):
        if marker in where:
            head, _, tail = where.rpartition(marker)
            return ("rlinf_hpc/" if marker == "/rlinf_hpc/" else "") + tail
    return where
