"""Rank 0's watch over every rank's heartbeat (`runtime.heartbeat`): a rank that stopped or
died is named.

Rank 0's `Watchdog` thread reads the heartbeats. A rank whose heartbeat is older than
``hang_timeout_s`` (SIGSTOP, a frozen process, a node gone) or whose process vanished (this
host only: its pid is gone) is reported with its rank, components, host and activity; every
rank's Python stack goes to ``RUN_DIR/stacks/`` first — live ranks dump their own (`faulthandler`,
from the heartbeat thread, so a main thread stuck in MPI still answers); a stopped one on this
host is read from outside, never resumed (``rank-N.outside.txt``: `stack_from_outside`). Then
the job's ``on_fatal`` ends it.

Heartbeats travel through the run directory, so a multi-node job needs the run directory on
a shared filesystem; ranks whose heartbeats rank 0 never sees are reported once and not watched.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlinf_hpc.log import get_logger
from rlinf_hpc.runtime import disk
from rlinf_hpc.runtime.crashes import crash_cause
from rlinf_hpc.runtime.deathwatch import exit_order
from rlinf_hpc.runtime.disk import is_disk_error
from rlinf_hpc.runtime.heartbeat import (
    DUMP_REQUEST,
    HEARTBEATS,
    STACKS,
    culprit_of,
    death_of,
    describe_problem,
    dump_own_stacks,
    pid_in_record_alive,
    read_heartbeat,
)
from rlinf_hpc.runtime.profiling import find_py_spy
from rlinf_hpc.runtime.stuck import stuck_waits

log = get_logger("watchdog")


def rank_of_process(run_dir: Path, host: str, pid: int) -> int | None:
    """The rank whose heartbeat says it is process ``pid`` on ``host``."""
    for path in (run_dir / HEARTBEATS).glob("rank-*.json"):
        record = read_heartbeat(path)
        if record and record.get("pid") == pid and record.get("host") == host:
            return int(record["rank"])
    return None


class Watchdog:
    """Rank 0's watch: `check` finds stopped and dead ranks; the thread acts on them."""

    def __init__(
        self,
        run_dir: Path,
        world_size: int,
        hang_timeout_s: float,
        interval: float,
        action: str,
        on_fatal: Callable[[str, dict[str, Any]], None],
        on_gpu_alarm: Callable[[int, dict[str, Any], dict[str, Any]], None] | None = None,
        checks: Sequence[Callable[[], None]] = (),
    ) -> None:
        self.run_dir = run_dir
        self.checks = list(checks)  # more watches on the same thread (NCCL's warnings)
        self.on_gpu_alarm = on_gpu_alarm
        self._gpu_seen: dict[int, int] = {}
        self.world_size = world_size
        self.hang_timeout_s = hang_timeout_s
        self.interval = interval
        self.action = action
        self.on_fatal = on_fatal
        self.started = time.time()
        self._seen: set[int] = set()
        self._warned: set[tuple[int, str]] = set()
        self._unseen_reported = False
        self._disk_refused_at = 0.0  # the last time its probe found the disk full
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()

    def check(self, now: float | None = None) -> list[dict[str, Any]]:
        """Problems now: ``{"rank", "kind": "stopped"|"died", "age_s", "record"}`` per rank."""
        now = time.time() if now is None else now
        host = socket.gethostname()
        problems = []
        records = self._records()  # read once: the stopped/died checks and the stuck waits
        # the death watch's record of exits (at the exit, before the process is reaped: a
        # killed rank tearing down still answers to its pid for a moment, under load longer)
        exited = exit_order(self.run_dir / HEARTBEATS)
        for rank, record in records.items():
            if rank == 0:
                continue
            self._seen.add(rank)
            # silence counts from the last moment the disk refused writes (heartbeats included)
            age = now - max(float(record.get("time", now)), self._disk_refused_at)
            beats = self.run_dir / HEARTBEATS
            gone = rank in exited or (
                record.get("host") == host and not pid_in_record_alive(record.get("pid"))
            )
            if gone or crash_cause(beats, rank) is not None:  # (a crash: any node's rank)
                problems.append(death_of(rank, record, age, beats))
            elif age > self.hang_timeout_s:
                problems.append({"rank": rank, "kind": "stopped", "age_s": age, "record": record})
        stopped = any(p["kind"] == "stopped" for p in problems)
        if (stopped or self.run_dir / HEARTBEATS in disk.watch().failing) and self._disk_refuses():
            # heartbeats that cannot be written are not stopped ranks: the disk is full (said
            # once; the job stops at a step boundary if it stays so, `disk.DiskWatch`)
            problems = [p for p in problems if p["kind"] != "stopped"]
        if not problems:
            problems = stuck_waits(records, now, self.hang_timeout_s)
        else:  # the dead first, in the order this node's death watch saw them exit
            order = exit_order(self.run_dir / HEARTBEATS)
            last = max(order.values(), default=-1) + 1  # after every rank it saw
            problems.sort(key=lambda p: (p["kind"] != "died", order.get(p["rank"], last), p["rank"]))
        if not self._unseen_reported and now - self.started > self.hang_timeout_s:
            self._unseen_reported = True
            unseen = sorted(set(range(1, self.world_size)) - self._seen)
            if unseen:
                log.warning(
                    "no heartbeat ever seen from ranks %s in %s (is the run directory on a shared "
                    "filesystem?): the watchdog cannot watch them", unseen, self.run_dir / HEARTBEATS,
                )  # fmt: skip
        return problems

    def _disk_refuses(self) -> bool:
        """Whether the heartbeats' directory takes no more writes now (a probe of one block)."""
        beats = self.run_dir / HEARTBEATS
        probe = beats / ".disk-probe"
        try:
            probe.write_bytes(b"\0" * 4096)
            probe.unlink()
        except OSError as exc:
            with contextlib.suppress(OSError):
                probe.unlink()
            if is_disk_error(exc):
                self._disk_refused_at = time.time()
                disk.watch().report(beats, exc)
                return True
            return False
        disk.watch().recovered(beats)
        return False

    def fail_if_dead(self, then: str) -> None:
        """End the job now, naming them, if ranks of this node have died (``then``: what
        happened next, for the message); returns if none has."""
        dead = self.dead()
        if dead:
            self._fail(dead, f"; {then}")

    def dead(self) -> list[dict[str, Any]]:
        """The problems of ranks that died (`check`'s ``died``), first seen first."""
        return [p for p in self.check() if p["kind"] == "died"]

    def _fail(self, problems: list[dict[str, Any]], more: str) -> None:
        self.on_fatal("; ".join(describe_problem(p) for p in problems) + more, culprit_of(problems[0]))

    def _records(self) -> dict[int, dict[str, Any]]:
        records = {}
        for rank in range(self.world_size):
            record = read_heartbeat(self.run_dir / HEARTBEATS / f"rank-{rank}.json")
            if record is not None:
                self._seen.add(rank)  # (one that left was seen: it is not "never seen")
            if record is not None and not record.get("left"):
                records[rank] = record
        return records

    def gpu_alarms(self) -> list[tuple[int, dict[str, Any], dict[str, Any]]]:
        """GPU alarms raised since the last call: ``(rank, heartbeat record, alarm)``, every rank."""
        out = []
        for rank in range(self.world_size):
            record = read_heartbeat(self.run_dir / HEARTBEATS / f"rank-{rank}.json")
            if record is None:
                continue
            seen = self._gpu_seen.get(rank, 0)
            for alarm in record.get("gpu_alarms") or []:
                if int(alarm.get("id", 0)) > seen:
                    out.append((rank, record, alarm))
                    self._gpu_seen[rank] = max(self._gpu_seen.get(rank, 0), int(alarm["id"]))
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.on_gpu_alarm is not None:
                for rank, record, alarm in self.gpu_alarms():
                    self.on_gpu_alarm(rank, record, alarm)
            for extra in self.checks:
                try:
                    extra()
                except Exception:  # noqa: BLE001 - a broken extra watch must not stop this one
                    log.exception("watch %s failed", getattr(extra, "__name__", extra))
            problems = self.check()
            if not problems:
                continue
            fresh = [p for p in problems if (p["rank"], p["kind"]) not in self._warned]
            if self.action == "warn":
                for problem in fresh:
                    self._warned.add((problem["rank"], problem["kind"]))
                    log.warning("%s", describe_problem(problem))
                continue
            # live ranks answer at their next beat: two beats are enough (4 s at most)
            stacks = collect_stacks(self.run_dir, problems, wait_s=min(4.0, 2 * self.interval + 0.5))
            self._fail(problems, f". Python stacks of every rank that could answer: {stacks}")
            return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 1)


def collect_stacks(run_dir: Path, problems: list[dict[str, Any]], wait_s: float = 4.0) -> Path:
    """Ask every live rank to dump its stacks; read stopped ranks on this host from outside.

    A stopped rank is never resumed (no SIGCONT, no ptrace attach, which resumes a stopped
    process when it detaches): py-spy reads its memory without pausing it (``--nonblocking``),
    and ``/proc`` says where its kernel thread waits; a stopped rank of another host has no
    stack here, and its file says so."""
    stacks = run_dir / STACKS
    stacks.mkdir(parents=True, exist_ok=True)
    request = f"{time.time():.3f}"
    (run_dir / HEARTBEATS / DUMP_REQUEST).write_text(request, encoding="utf-8")
    dump_own_stacks(stacks, 0, request)
    host = socket.gethostname()
    for problem in problems:
        record = problem["record"]
        if problem["kind"] != "stopped":
            continue
        path = stacks / f"rank-{problem['rank']}.outside.txt"
        if record.get("host") != host:
            text = f"rank {problem['rank']} runs on {record.get('host')}: no stack is read from {host}\n"
        else:
            text = stack_from_outside(int(record["pid"]))
        with contextlib.suppress(OSError):
            path.write_text(text, encoding="utf-8")
    time.sleep(wait_s)  # live ranks answer at their next beat
    return stacks


def stack_from_outside(pid: int) -> str:
    """What can be read of process ``pid`` without running it: its state and kernel wait
    (``/proc``), and its Python stacks (py-spy ``--nonblocking``, where installed)."""
    lines = [f"# pid {pid}, read from outside (the process was not resumed)"]
    for name in ("status", "wchan"):
        with contextlib.suppress(OSError):
            text = Path(f"/proc/{pid}/{name}").read_text(encoding="ascii", errors="replace")
            if name == "status":
                text = next((line for line in text.splitlines() if line.startswith("State:")), "")
            lines.append(f"{name}: {text.strip()}")
    spy = find_py_spy()
    if spy is None:
        lines.append("no Python stack: py-spy is not installed (pip install py-spy)")
        return "\n".join(lines) + "\n"
    try:
        done = subprocess.run(
            [spy, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True, timeout=15
        )
        lines.append(done.stdout + done.stderr)
    except (OSError, subprocess.TimeoutExpired) as exc:
        lines.append(f"py-spy could not read pid {pid}: {exc}")
    return "\n".join(lines) + "\n"
