#!/usr/bin/env python
"""The watchdog's figures: its cost on the main job, and how fast it names a stopped, a killed
and a leaking rank.

    python tools/bench_watchdog.py [--json PATH] [--steps 20] [--pairs 2]

* ``overhead``: the main job (configs/math_grpo_tiny.toml, ``--steps`` GRPO steps, warm start
  cached after the first run) with the watchdog off and on, alternating ``--pairs`` times in
  one run; mean step time (after the first two steps) on ÷ off − 1 (required ≤ 0.01; on a
  shared 2-core box single runs move by a few percent, so read it with its spread).
* ``hang_report_s``: a probe job (tests/job_workers.py) with ``hang_timeout_s = 6``; one rank
  is SIGSTOPped and the time until the job names it is measured (required ≤ 6 + 5 s).
* ``kill_report_s``: one rank is ``kill -9``ed; the time until its rank and component are
  named (required ≤ 5 s).
* ``crash_report_s``: one rank segfaults (a C call reading address 0); the time from its crash
  file's write (faulthandler's dump) until the job names the rank, the signal and the frame
  (required ≤ 5 s).
* ``leak_rate_error``: a stage that keeps 8 MB per step; |reported rate − 8| ÷ 8 (≤ 0.2).
* ``stuck_report_s``: a rank waits in a broadcast whose root never enters it (its heartbeat
  goes on); the time from entering the wait until the job names the operation and the missing
  rank (required ≤ 6 + 5 s).

Rank pids come from the run's heartbeat files, as an operator would find them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import check_ratios, write_json

REPO = Path(__file__).resolve().parents[1]
RLINF = str(Path(sys.executable).parent / "rlinf-hpc")
REQUIRED = {
    "overhead": ("<=", 0.01),
    "hang_report_s": ("<=", 11.0),
    "kill_report_s": ("<=", 5.0),
    "crash_report_s": ("<=", 5.0),
    "leak_rate_error": ("<=", 0.2),
    "stuck_report_s": ("<=", 11.0),
}


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "tests")}


def main_job_step_s(out: Path, cache: Path, steps: int, enabled: bool, n: int) -> float:
    run_dir = out / f"main-{'on' if enabled else 'off'}-{n}"
    sets = [f"grpo.steps={steps}", f"grpo.eval_every={steps}", f"sft.cache_dir={cache}",
            "checkpoint.enabled=false", f"watchdog.enabled={'true' if enabled else 'false'}"]  # fmt: skip
    command = [RLINF, "run", str(REPO / "configs" / "math_grpo_tiny.toml"), "--run-dir", str(run_dir)]
    for item in sets:
        command += ["--set", item]
    done = subprocess.run(command, capture_output=True, text=True, env=env(), timeout=1200)
    if done.returncode:
        raise SystemExit(f"main job failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.fmean(m["step_s"] for m in metrics[2:] or metrics)


def probe_config(out: Path, flow: str, extra: str) -> Path:
    path = out / f"{flow}.toml"
    path.write_text(
        '[job]\nname = "probe"\nnum_ranks = 3\ncall_timeout_s = 60\n'
        f"[watchdog]\nheartbeat_s = 1.0\nhang_timeout_s = 6.0\n{extra}"
        '[components.alpha]\nworker = "job_workers:ProbeWorker"\n'
        '[components.beta]\nworker = "job_workers:ProbeWorker"\n'
        f'[flow]\nrunner = "job_workers:{flow}"\n'
    )
    return path


def time_to_name(out: Path, how: str) -> float:
    """Start the probe job, wait for its heartbeats (and death watch), hit rank 2, time the report."""
    run_dir = out / f"probe-{how}"
    proc = subprocess.Popen(
        [RLINF, "run", str(probe_config(out, "signal_flow", "")), "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(), start_new_session=True,
    )  # fmt: skip
    beat, ready = run_dir / "heartbeats" / "rank-2.json", run_dir / "heartbeats" / "deathwatch.json"
    deadline = time.monotonic() + 60
    while not (beat.exists() and ready.exists()) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # the flow's long call is under way
    pid = json.loads(beat.read_text())["pid"]
    hit = time.monotonic()
    os.kill(pid, signal.SIGSTOP if how == "stop" else signal.SIGKILL)
    needle = "no heartbeat for" if how == "stop" else "died while in"
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if needle in line and "rank 2 (beta)" in line:
                return time.monotonic() - hit
        raise SystemExit(f"the {how} was never reported")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        proc.wait(timeout=60)


def crash_report_s(out: Path) -> float:
    """Rank 1 segfaults: from its crash file's write to the report naming the crash."""
    run_dir = out / "crash"
    command = [RLINF, "run", str(probe_config(out, "crash_flow", "")), "--run-dir", str(run_dir)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(),
                            start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if "rank 1 (alpha)" in line and "crashed below Python" in line:
                return time.time() - (run_dir / "heartbeats" / "rank-1.crash").stat().st_mtime
        raise SystemExit("the crash was never reported")
    finally:
        proc.wait(timeout=60)


def stuck_report_s(out: Path) -> float:
    """Rank 2 waits in a broadcast rank 1 never calls: from the wait's start (its heartbeat
    says since when) to the report naming the missing rank."""
    path = out / "stuck.toml"
    path.write_text(probe_config(out, "stuck_flow", "").read_text().replace(
        '[components.alpha]\nworker = "job_workers:ProbeWorker"\n',
        '[components.alpha]\nworker = "job_workers:ProbeWorker"\nnum_ranks = 2\n',
    ).replace("num_ranks = 3", "num_ranks = 4"))  # fmt: skip
    run_dir = out / "stuck"
    command = [RLINF, "run", str(path), "--run-dir", str(run_dir)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(),
                            start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if "missing from it: rank 1" in line:
                reported = time.time()
                record = json.loads((run_dir / "heartbeats" / "rank-2.json").read_text())
                return reported - float(record["wait"]["since"])
        raise SystemExit("the stuck broadcast was never reported")
    finally:
        proc.wait(timeout=60)


def leak_rate(out: Path, mb: float) -> float:
    path = out / "leak.toml"
    path.write_text(
        '[job]\nname = "leak"\nnum_ranks = 2\n'
        "[watchdog]\nheartbeat_s = 0.1\nhang_timeout_s = 30\nleak_window = 10\nleak_mb_per_step = 2\n"
        "leak_min_growth_mb = 40\n"
        f'[components.alpha]\nworker = "job_workers:LeakyWorker"\noptions = {{ leak_mb = {mb} }}\n'
        '[flow]\nrunner = "job_workers:leak_flow"\n'
    )
    run_dir = out / "leak"
    subprocess.run(
        [RLINF, "run", str(path), "--run-dir", str(run_dir)], capture_output=True, env=env(), timeout=300
    )
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    alarms = [e for e in events if e["event"] == "memory_leak"]
    if not alarms:
        raise SystemExit("the injected leak was not reported")
    return float(alarms[0]["mb_per_step"])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="bench-watchdog-"))
    cache = out / "sft-cache"
    main_job_step_s(out, cache, 2, False, -1)  # trains and caches the warm start
    off, on = [], []
    for n in range(args.pairs):
        off.append(main_job_step_s(out, cache, args.steps, False, n))
        on.append(main_job_step_s(out, cache, args.steps, True, n))
    raw = {
        "step_s_off": off, "step_s_on": on,
        "hang_report_s": time_to_name(out, "stop"), "kill_report_s": time_to_name(out, "kill"),
        "leak_mb_per_step": leak_rate(out, 8.0), "stuck_report_s": stuck_report_s(out),
        "crash_report_s": crash_report_s(out),
    }  # fmt: skip
    ratios = {
        "overhead": statistics.fmean(on) / statistics.fmean(off) - 1.0,
        "hang_report_s": raw["hang_report_s"],
        "kill_report_s": raw["kill_report_s"],
        "crash_report_s": raw["crash_report_s"],
        "leak_rate_error": abs(raw["leak_mb_per_step"] - 8.0) / 8.0,
        "stuck_report_s": raw["stuck_report_s"],
    }
    listed = {k: ", ".join(f"{x:.3f}" for x in raw[f"step_s_{k}"]) for k in ("off", "on")}
    print(f"main job step s, watchdog off: {listed['off']}; on: {listed['on']}")
    print(f"stopped rank named after {raw['hang_report_s']:.1f} s (hang_timeout_s 6); killed rank")
    print(
        f"named after {raw['kill_report_s']:.1f} s; 8 MB/step leak reported at {raw['leak_mb_per_step']:.2f}"
    )
    print(f"a rank stuck in a broadcast named with the missing rank after {raw['stuck_report_s']:.1f} s")
    print(f"a segfaulted rank named with the signal and its frames after {raw['crash_report_s']:.1f} s")
    rows, ok = check_ratios(ratios, REQUIRED, digits=3)
    print(f"\n{'ratio':<18}{'value':>9}  {'required':<10}status")
    for name, value, bound, status in rows:
        print(f"{name:<18}{value:>9}  {bound:<10}{status}")
    write_json(args.json, {"ratios": ratios, "raw": raw})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
