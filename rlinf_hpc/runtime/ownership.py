"""Which job owns a directory: a ``LOCK`` file naming it (SLURM job id, host, pid, run id),
refreshed while the job lives, so that two jobs never write one run or checkpoint directory.

A lock is *live* when its owner may still run: on this host, its pid exists and started before
the lock was written (not a later process that reused the pid); on another host, its file was
refreshed within `STALE_AFTER_S` (the owner touches it every `REFRESH_S`; a job killed with
``kill -9`` or a lost node stops doing so). A lock left by an earlier run of the same SLURM job
(a requeue) is never live.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from rlinf_hpc.errors import UserError
from rlinf_hpc.log import get_logger

log = get_logger("ownership")

REFRESH_S = 20.0
STALE_AFTER_S = 90.0


class DirectoryLock:
    """``acquire`` (or `UserError` naming the owner), refresh in a daemon thread, `release`."""

    def __init__(self, path: Path, what: str, fix: str) -> None:
        self.path = path
        self.what = what  # e.g. "run directory 'runs/x'"
        self.fix = fix  # what to do instead, for the refusal
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refuse_if_held(self, job_id: str | None) -> dict[str, Any] | None:
        """`UserError` naming the owner if another live job holds the lock; else the stale
        owner record (None when there is no lock)."""
        held = read_lock(self.path)
        if held is not None and lock_is_live(held, job_id, self.path):
            raise UserError(
                f"{self.what} belongs to another running job (SLURM job {held.get('job_id') or '-'}, "
                f"host {held.get('host')}, pid {held.get('pid')}, run {held.get('run_id') or '-'}): two "
                f"jobs writing one directory would overwrite each other's results. {self.fix} If that "
                f"job is gone (and its lock is not refreshed for {STALE_AFTER_S:.0f} s it counts as "
                f"gone), delete {self.path}."
            )
        return held

    def acquire(self, job_id: str | None, run_id: str = "") -> None:
        owner = {
            "job_id": job_id, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time(),
            "run_id": run_id,
        }  # fmt: skip
        held = self.refuse_if_held(job_id)
        if held is not None:
            log.info("taking over the lock of a finished run of %s (%s)", self.what, held)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(owner), encoding="utf-8")
        tmp.replace(self.path)
        self._thread = threading.Thread(target=self._refresh, name=f"lock-{self.path.name}", daemon=True)
        self._thread.start()

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        held = read_lock(self.path)
        if held is not None and held.get("pid") == os.getpid() and held.get("host") == socket.gethostname():
            with contextlib.suppress(OSError):
                self.path.unlink()


def read_lock(path: Path) -> dict[str, Any] | None:
    """The lock's owner record; ``{}`` for an unreadable one, None when there is no lock."""
    try:
        held = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError):
        return {}
    return held if isinstance(held, dict) else {}


def lock_is_live(held: dict[str, Any], job_id: str | None, path: Path) -> bool:
    if not held:
        return False
    if job_id is not None and held.get("job_id") == job_id:
        return False  # an earlier run of this same SLURM job (requeued): it is gone
    if held.get("host") == socket.gethostname():
        pid = held.get("pid")
        if not isinstance(pid, int) or not pid_alive(pid):
            return False
        return _pid_started_before(pid, held.get("since"))
    try:  # another host: its process cannot be checked from here, its refreshes can
        return time.time() - path.stat().st_mtime < STALE_AFTER_S
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` (on this host) still runs; a zombie (killed, not yet reaped by
    its parent) does not, and one we may not signal is assumed to."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        import psutil

        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except Exception:  # noqa: BLE001 - unknown: assume it runs
        return True


def _pid_started_before(pid: int, since: Any) -> bool:
    """Whether process ``pid`` is the lock's owner (not a later process that reused the pid)."""
    try:
        import psutil

        return psutil.Process(pid).create_time() <= float(since) + 1.0
    except Exception:  # noqa: BLE001 - unknown: assume it is the owner
        return True
