"""What watches a running job from rank 0: the heartbeat watchdog (a stopped or dead rank ends
the job, named), the death watch (names a rank killed outright), the memory-leak monitor, the
warning before the OOM killer."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

from rlinf_hpc.comm.mpi import abort
from rlinf_hpc.config import Config
from rlinf_hpc.log import get_logger
from rlinf_hpc.runtime import deathwatch
from rlinf_hpc.runtime.accounting import claim_culprit, claim_end
from rlinf_hpc.runtime.events import EventLog
from rlinf_hpc.runtime.gpu_health import FAULT_KINDS
from rlinf_hpc.runtime.heartbeat import HEARTBEATS, read_heartbeat
from rlinf_hpc.runtime.leaks import LeakMonitor, make_step_hook
from rlinf_hpc.runtime.nccl import NcclLogWatch
from rlinf_hpc.runtime.oomkill import PressureWatch, describe_pressure
from rlinf_hpc.runtime.rundir import RunDirectory
from rlinf_hpc.runtime.signals import request_stop
from rlinf_hpc.runtime.watchdog import Watchdog, rank_of_process
from rlinf_hpc.scheduler import Coordinator

log = get_logger("job")


def start_watchdog(
    config: Config, world_size: int, directory: RunDirectory, events: EventLog, started: float
) -> Watchdog | None:
    """Rank 0's watch over every rank's heartbeat; a stopped or dead rank ends the job, named."""
    watch = config.watchdog
    if not watch.enabled or world_size < 2:
        return None

    def on_fatal(message: str, culprit: dict[str, Any]) -> None:
        wall = round(time.monotonic() - started, 3)
        outcome = f"rank {culprit['error']}"
        won, outcome, named = claim_culprit(directory.path, directory.run_id, outcome, culprit)
        if won:
            log.error("job failed: %s", message)
        else:  # the job's culprit was named first (a signal, a failure): this followed from it
            first = f"rank {named['rank']} ({named['component']}): {named['error']}"
            log.warning("%s (after %s, named first)", message, first)
        try:
            if claim_end(directory.path, directory.run_id, "watchdog"):
                events.write("end", outcome=outcome, wall_seconds=wall, culprit=named)
            directory.write_summary(
                {"outcome": outcome, "interrupted": True, "wall_seconds": wall, "culprit": named}
            )
        except Exception:  # noqa: BLE001 - the job must end whatever the disk says
            log.exception("could not record the failure in the run directory")
        abort(1)  # the main thread may be waiting on the lost rank: end every rank from here

    def on_gpu_alarm(rank: int, record: dict[str, Any], alarm: dict[str, Any]) -> None:
        act_on_gpu_alarm(watch, rank, record, alarm, events.write, on_fatal)

    nccl_logs = NcclLogWatch(directory.path, lambda host, pid: rank_of_process(directory.path, host, pid))

    def nccl_warnings() -> None:
        """NCCL's own warnings (NCCL_DEBUG_FILE in the run directory), named by rank."""
        for found in nccl_logs.scan():
            rank = found["rank"]
            who = f"rank {rank}" if rank is not None else f"pid {found['pid']}"
            log.warning("NCCL on %s (%s): %s", who, found["host"], found["line"])
            events.write("nccl_warning", **found)

    pressure = PressureWatch(watch.memory_warn_fraction)
    beats = [directory.path / HEARTBEATS / f"rank-{rank}.json" for rank in range(world_size)]

    def memory_pressure() -> None:
        """A memory cgroup or node nearly full: the ranks holding most, before the OOM killer."""
        records = {rank: record for rank, path in enumerate(beats) if (record := read_heartbeat(path))}
        for warning in pressure.scan({r: rec for r, rec in records.items() if not rec.get("left")}):
            log.warning("memory: %s", describe_pressure(warning))
            events.write("memory_pressure", **warning)

    return Watchdog(
        directory.path, world_size, watch.hang_timeout_s, watch.heartbeat_s, watch.action, on_fatal,
        on_gpu_alarm if watch.gpu_health else None, [nccl_warnings, memory_pressure],
    )  # fmt: skip


def act_on_gpu_alarm(
    watch: Any,
    rank: int,
    record: dict[str, Any],
    alarm: dict[str, Any],
    write_event: Any,
    on_fatal: Any,
) -> str:
    """Rank 0's answer to a rank's GPU alarm (`runtime.gpu_health`): log it, record a
    ``gpu_health`` event, and act as `[watchdog]` says; returns the action taken."""
    kind = alarm.get("kind", "?")
    who = f"rank {rank} ({record.get('roles') or '-'}) on {record.get('host')}"
    if kind in FAULT_KINDS:
        action = watch.gpu_fault_action
    elif kind == "overheat":
        action = watch.gpu_temp_action
    elif kind == "still_hot":
        action = "checkpoint_stop"
    else:  # cooled, a pending row remapping, throttling
        action = "warn"
    message = f"{who}: {alarm.get('message')}"
    (log.info if kind == "cooled" else log.warning)("%s (action %s)", message, action)
    write_event("gpu_health", rank=rank, host=record.get("host"), component=record.get("roles"),
                kind=kind, device=alarm.get("device"), value=alarm.get("value"),
                message=alarm.get("message"), action=action)  # fmt: skip
    if action == "checkpoint_stop":
        request_stop(f"GPU {kind} on rank {rank}")
    elif action == "abort":
        on_fatal(message, {"rank": rank, "component": record.get("roles"), "host": record.get("host"),
                           "error": f"GPU {kind}", "activity": record.get("activity")})  # fmt: skip
    return action


class DeathWatch:
    """The helper that names a rank of this node that dies (`runtime.deathwatch`), supervised:
    a helper that ended before its work was done (killed, crashed) is started again for the
    ranks still in the job, with a warning and a ``deathwatch_restarted`` event; after
    `RESTARTS` it is given up loudly (``deathwatch_lost``): a dead rank of this node would then
    be named by the watchdog's heartbeat check only, without the order of the exits."""

    RESTARTS = 3

    def __init__(self, directory: RunDirectory, events: EventLog) -> None:
        self.directory = directory
        self.events = events
        self.restarts = 0
        self.proc = self._start()

    def _start(self) -> Any:
        host = socket.gethostname()
        pids = {}
        for path in (self.directory.path / HEARTBEATS).glob("rank-*.json"):
            record = read_heartbeat(path)
            if record and record.get("host") == host and not record.get("left"):
                pids[int(record["rank"])] = int(record["pid"])
        return deathwatch.start(self.directory.path, self.directory.run_id, pids)

    def check(self) -> None:
        """On the watchdog's thread: start the helper again if it ended before its work was done."""
        if self.proc is None or (code := self.proc.poll()) is None or code == 0:
            return  # not needed (no pidfd, no local rank), running, or done (named, or all left)
        if self.directory.claimed() is not None:
            return  # it ended with the job, whose culprit is named
        pid, self.proc = self.proc.pid, None
        if self.restarts >= self.RESTARTS:
            log.error(
                "the death watch (pid %d) ended with code %d, %d times: a rank of this node killed "
                "outright is now named by the heartbeat watch only, without the order of the exits",
                pid, code, self.restarts + 1,
            )  # fmt: skip
            self.events.write("deathwatch_lost", pid=pid, returncode=code, restarts=self.restarts)
            return
        self.restarts += 1
        self.proc = self._start()
        new = self.proc.pid if self.proc is not None else None
        log.warning("the death watch (pid %d) ended with code %d: started again (pid %s)", pid, code, new)
        self.events.write(
            "deathwatch_restarted", pid=pid, returncode=code, new_pid=new, restarts=self.restarts
        )


def memory_hook(config: Config, coordinator: Coordinator, run_dir: Path, events: EventLog) -> Any:
    """The memory-leak monitor over every rank's heartbeat (`runtime.leaks`)."""
    watch = config.watchdog
    monitor = LeakMonitor(watch.leak_window, watch.leak_mb_per_step, watch.leak_min_growth_mb)
    beats = [run_dir / HEARTBEATS / f"rank-{rank}.json" for rank in range(coordinator.control.size)]

    def read_usage() -> dict[tuple[int, str], float]:
        usage = {}
        for rank, path in enumerate(beats):
            record = read_heartbeat(path) or {}
            for kind, key in (("host", "rss_mb"), ("device", "device_mb")):
                if key in record and not record.get("left"):
                    usage[(rank, kind)] = float(record[key])
        return usage

    def describe(rank: int) -> str:
        record = read_heartbeat(beats[rank]) or {}
        return f"rank {rank} ({record.get('roles') or '-'}) on {record.get('host')}"

    def release() -> None:
        for name in coordinator.placement.groups:
            coordinator.group(name).call("free_memory").result()

    return make_step_hook(monitor, read_usage, describe, watch.leak_action, release, events.write)
