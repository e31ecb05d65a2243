"""Every rank's heartbeat: a thread that says, through the run directory, that the rank lives
and what its main thread does.

`Heartbeat` (it sleeps between beats: no busy-waiting) writes ``RUN_DIR/heartbeats/rank-N.json``
every ``heartbeat_s``: pid, host, the components it serves, what its main thread is doing (the
method and since when, the wait it is in) and its memory in use. A long call keeps beating — the
thread is not the main thread — so rank 0's watch (`runtime.watchdog`) checks liveness, not call
length. The thread also answers a stack-dump request (`faulthandler`, so a main thread stuck in
MPI still answers), polls the GPU guard, and ends a worker whose rank 0 died.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from rlinf_hpc.comm.waiting import current_wait
from rlinf_hpc.imports import loaded
from rlinf_hpc.log import get_logger
from rlinf_hpc.runtime.accounting import claim_culprit, culprit_record
from rlinf_hpc.runtime.crashes import CrashRecorder, crash_cause
from rlinf_hpc.runtime.disk import describe_free, is_disk_error
from rlinf_hpc.runtime.oomkill import boot_seconds, cgroup_state, death_cause
from rlinf_hpc.runtime.ownership import pid_alive
from rlinf_hpc.runtime.progress import current_progress

log = get_logger("watchdog")

HEARTBEATS = "heartbeats"
STACKS = "stacks"
DUMP_REQUEST = "DUMP"


class Heartbeat:
    """This rank's heartbeat thread; `doing` records what the main thread is busy with."""

    def __init__(self, run_dir: Path, rank: int, interval: float, hang_timeout_s: float = 120.0) -> None:
        self.run_dir = run_dir
        self.hang_timeout_s = hang_timeout_s
        self.dir = run_dir / HEARTBEATS
        self.stacks = run_dir / STACKS
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.interval = interval
        self.roles = "coordinator" if rank == 0 else ""
        self.activity, self.since = "starting", time.time()
        self.boot_s = boot_seconds()  # its start on the kernel log's clock (`oomkill`)
        self._dumped: str | None = None
        self._errors: set[str] = set()  # kinds of beat failures logged already
        self.disk_full = False  # its last beat failed: the run directory's disk is full
        self.disk_full_at = 0.0  # when a beat last failed so
        self.gpu: Any = None  # `GpuGuard` once a component of this rank works on a GPU
        self._stop = threading.Event()
        self._write_lock = threading.Lock()  # the main thread beats too, on a new component
        self._crashes = CrashRecorder(self.dir, rank)  # a crash below Python: its stacks there
        self._beat()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def doing(self, activity: str | None, roles: str | None = None) -> None:
        first = self.activity == "starting"
        self.activity, self.since = activity or "idle", time.time()
        if first or (roles is not None and roles != self.roles):
            self.roles = roles if roles is not None else self.roles
            # a new component, or the rank's first activity: say so now, not at the next beat
            # (a coordinator killed in its first seconds was reported as "starting")
            with contextlib.suppress(OSError):
                self._beat()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._poll_gpu()
            try:
                self._beat()
                if self.disk_full:
                    self.disk_full = False
                    log.warning("rank %d writes its heartbeat again", self.rank)
                self._answer_dump_request()
                if self.rank != 0:
                    self._watch_coordinator()
            except OSError as exc:
                if not is_disk_error(exc):  # a vanished run directory: say so once, stop beating
                    log.warning("heartbeat of rank %d stopped: %s", self.rank, exc)
                    return
                if not self.disk_full:  # full: beat again at every interval, said once
                    log.warning(
                        "rank %d cannot write its heartbeat: the run directory is full (%s, %s); "
                        "it goes on trying (the watchdog does not count a full disk as a stopped rank)",
                        self.rank, exc.strerror or exc, describe_free(self.dir),
                    )  # fmt: skip
                self.disk_full, self.disk_full_at = True, time.time()
            except Exception as exc:  # noqa: BLE001 - a bug in one figure must not silence the rank
                # (the thread ended here before, and the watchdog named the rank frozen 2 min
                # later); said once per kind of error, the next beat tries again
                kind = f"{type(exc).__name__}: {exc}"
                if kind not in self._errors:
                    self._errors.add(kind)
                    log.exception("heartbeat of rank %d failed (%s); it goes on beating", self.rank, kind)

    def watch_gpu(self, guard: Any) -> None:
        """Poll ``guard`` (a `GpuGuard`) on every beat and carry its figures and alarms."""
        self.gpu = guard

    def _poll_gpu(self) -> None:
        if self.gpu is None:
            return
        try:
            self.gpu.poll()
        except Exception as exc:  # noqa: BLE001 - a broken NVML must not stop the heartbeat
            log.warning("GPU health checks of rank %d stopped: %s", self.rank, exc)
            self.gpu = None

    def _beat(self, left: bool = False) -> None:
        record = {
            "rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
            "roles": self.roles, "activity": self.activity, "since": self.since, "left": left,
            "wait": current_wait(), "progress": current_progress(), "boot_s": self.boot_s, **cgroup_state(),
            **memory_in_use(), **(self.gpu.record() if self.gpu is not None else {}),
        }  # fmt: skip
        path = self.dir / f"rank-{self.rank}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        with self._write_lock:
            tmp.write_text(json.dumps(record), encoding="utf-8")
            tmp.replace(path)

    def _answer_dump_request(self) -> None:
        try:
            request = (self.dir / DUMP_REQUEST).read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return
        if request and request != self._dumped:
            self._dumped = request
            dump_own_stacks(self.stacks, self.rank, request)

    def _watch_coordinator(self) -> None:
        """A worker's watch over rank 0, which nothing else watches: when it died (this host)
        or went silent, say so, record it in the summary (rank 1) and leave — with Hydra's
        auto-cleanup off nothing else would end this rank."""
        record = read_heartbeat(self.dir / "rank-0.json")
        if record is None or record.get("left"):
            return
        problem = None
        if record.get("host") == socket.gethostname() and not pid_in_record_alive(record.get("pid")):
            problem = death_of(0, record, heartbeats=self.dir)
        # silence counts from the last beat this rank could not write either (a full disk stops
        # rank 0's beats as well: not a stopped coordinator)
        elif (
            time.time() - max(float(record.get("time", time.time())), self.disk_full_at) > self.hang_timeout_s
        ):
            problem = {
                "rank": 0,
                "kind": "stopped",
                "age_s": time.time() - float(record["time"]),
                "record": record,
            }
        if problem is None:
            return
        log.error("job failed: %s; rank %d leaves", describe_problem(problem), self.rank)
        if self.rank == 1:
            record_culprit(self.run_dir, problem)
        with contextlib.suppress(OSError):  # it leaves on purpose: not a rank that died
            self._beat(left=True)
        os._exit(1)

    def close(self) -> None:
        """The rank leaves normally: a last beat says so (the watch then ignores it)."""
        self._stop.set()
        self._thread.join(timeout=self.interval + 1)
        if self.gpu is not None:
            self.gpu.close()
        try:
            self.doing("left")
            self._beat(left=True)
        except OSError:
            pass
        self._crashes.close()


def memory_in_use() -> dict[str, float]:
    """This process's host RSS and, where CUDA is up, its device memory in use (MB)."""
    out: dict[str, float] = {}
    try:
        import psutil

        out["rss_mb"] = psutil.Process().memory_info().rss / 2**20
    except Exception:  # noqa: BLE001 - no psutil: no memory figures
        pass
    torch = loaded("torch")  # never import torch here: only report what is in use
    try:
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            out["device_mb"] = torch.cuda.memory_allocated() / 2**20
    except Exception:  # noqa: BLE001 - a figure must never stop the heartbeat thread
        pass
    return out


def dump_own_stacks(directory: Path, rank: int, request: str) -> Path:
    """Every thread's Python stack of this process into ``directory/rank-N.txt``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank-{rank}.txt"
    with path.open("w", encoding="utf-8") as out:
        out.write(f"# rank {rank} pid {os.getpid()} host {socket.gethostname()} request {request}\n")
        out.flush()
        faulthandler.dump_traceback(out, all_threads=True)
    return path


def read_heartbeat(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def pid_in_record_alive(pid: Any) -> bool:
    """`pid_alive` for a heartbeat's pid field (not a number: assume it runs)."""
    return not isinstance(pid, int) or pid_alive(pid)


def death_of(
    rank: int, record: dict[str, Any], age_s: float = 0.0, heartbeats: Path | None = None
) -> dict[str, Any]:
    """The problem "rank ``rank`` died", with why where that is known: a crash below Python
    (its crash file in ``heartbeats``, `crashes`), or — read on its node only — the kernel's OOM
    killer (`oomkill.death_cause`)."""
    problem = {"rank": rank, "kind": "died", "age_s": age_s, "record": record}
    cause = crash_cause(heartbeats, rank) if heartbeats is not None else None
    if cause is None and record.get("host") == socket.gethostname():
        cause = death_cause(record)
    if cause is not None:
        problem["cause"] = cause
    return problem


def culprit_of(problem: dict[str, Any]) -> dict[str, Any]:
    """The ``culprit`` of summary.json and events.jsonl for a watchdog's ``problem`` (its
    ``cause``: the evidence's kind — crash, oom_kill — else the problem's: died, stopped, stuck)."""
    record = problem["record"]
    evidence = problem.get("cause") or {}
    culprit = culprit_record(
        problem["rank"], record.get("roles"), evidence.get("kind", problem["kind"]), problem["kind"],
        record.get("host"), activity=record.get("activity"),
    )  # fmt: skip
    if evidence:
        culprit["cause_detail"] = evidence["detail"]
    for key in ("simultaneous", "seen_first"):  # the death watch's: exits seen with this one
        if problem.get(key) is not None:
            culprit[key] = problem[key]
    return culprit


def record_culprit(run_dir: Path, problem: dict[str, Any]) -> bool:
    """Name ``problem`` as why this run ended, from outside the coordinator (the death watch,
    rank 1 for a dead coordinator), unless a culprit was named first: then nothing is written.
    True if this named it."""
    path = run_dir / "summary.json"
    summary = read_heartbeat(path) or {}
    if summary.get("outcome") != "running" or not summary.get("run_id"):
        return False  # this run ended with its own account (or the directory is another run's)
    outcome, culprit = f"rank {problem['kind']}", culprit_of(problem)
    won, _, _ = claim_culprit(run_dir, summary["run_id"], outcome, culprit)
    if won:
        summary.update(outcome=outcome, interrupted=True, culprit=culprit)
        tmp = path.with_name(f".summary.json.{os.getpid()}")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(summary, indent=2), encoding="utf-8")
            tmp.replace(path)
    return won


def describe_problem(problem: dict[str, Any]) -> str:
    record = problem["record"]
    doing = record.get("activity") or "idle"
    busy_for = time.time() - float(record.get("since", time.time()))
    who = f"rank {problem['rank']} ({record.get('roles') or 'no component'}) on {record.get('host')}"
    if problem["kind"] == "died":
        cause = f": {problem['cause']['detail']}" if problem.get("cause") else ""
        return f"{who}, pid {record.get('pid')}, died while in {doing} ({busy_for:.0f} s){cause}"
    if problem["kind"] == "stuck":
        return f"{who}, pid {record.get('pid')}: {problem['detail']}"
    return (
        f"{who}, pid {record.get('pid')}: no heartbeat for {problem['age_s']:.0f} s while in {doing} "
        "(the process is stopped or frozen: SIGSTOP, a debugger, swapping, a lost node)"
    )
