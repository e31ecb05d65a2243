"""The run directory's filesystem: a full (or read-only, or over-quota) disk as one clear event.

`is_disk_error` tells ENOSPC/EDQUOT/EROFS from other I/O errors. The JSONL files of rank 0
(`AppendFile`: events, metrics) keep what the disk refused, in order, to write it once it
takes writes again, and report to the process's `DiskWatch` (`watch`), which says so once and
decides at step boundaries whether the job can go on: a failed checkpoint frees its partial
folder, so one boundary of grace is given, and past it the job stops with `DiskFull` (its own
exit code, `EXIT_DISK_FULL`, and ``culprit.cause = "disk_full"`` with the path and the free
space). A `Reserve` of a few MB, taken at the start, is given back then so that the summary,
the ``end`` event and the timeline still fit.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "DISK_ERRNOS",
    "EXIT_DISK_FULL",
    "DiskFull",
    "DiskWatch",
    "AppendFile",
    "Reserve",
    "describe_free",
    "free_bytes",
    "is_disk_error",
]

#: The errors that mean "this filesystem takes no more": full, over quota, read-only.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
#: The job's exit code when it stopped because the run directory could not be written
#: (ENOSPC's number).
EXIT_DISK_FULL = 28


def is_disk_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in DISK_ERRNOS


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s filesystem (None: unknown)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        stat = os.statvfs(probe)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def describe_free(path: Path) -> str:
    free = free_bytes(path)
    return f"{free / 1e6:.1f} MB free" if free is not None else "free space unknown"


class DiskFull(Exception):
    """Rank 0 cannot write the run directory (``path``) and nothing freed room: the job stops."""

    exit_code = EXIT_DISK_FULL

    def __init__(self, path: Path, error: OSError) -> None:
        self.path = path
        self.error = error
        self.free = free_bytes(path)
        super().__init__(
            f"the run directory's filesystem takes no more ({error.strerror or error} writing {path}; "
            f"{describe_free(path)}): free space there (or give --run-dir on a larger filesystem, fewer "
            "checkpoint.keep) and resume"
        )


class DiskWatch:
    """Rank 0's account of the run directory's disk errors (any thread reports them).

    ``report(path, error)`` says the first one of a spell, once; ``recovered(path)`` its end.
    `check` (at each step boundary) raises `DiskFull` when a spell lasted through a whole step:
    ``retry`` (the writers' flush of their held lines) is tried first."""

    def __init__(self, log_warning: Callable[[str], None], event: Callable[..., None] | None = None) -> None:
        self._warn = log_warning
        self._event = event
        self._lock = threading.Lock()
        self.failing: dict[Path, OSError] = {}
        self._boundaries_failing = 0
        self.retries: list[Callable[[], None]] = []
        self._queued: list[dict[str, object]] = []  # disk_full events not yet written

    def bind(self, event: Callable[..., None]) -> None:
        """Record each spell as an event too (rank 0's ``events.jsonl``)."""
        self._event = event

    def report(self, path: Path, error: OSError) -> None:
        with self._lock:
            first = not self.failing
            self.failing[path] = error
        if first:  # the event is written at the next `check`: a writer may be holding its lock
            self._warn(
                f"the run directory is full ({error.strerror or error} writing {path}; "
                f"{describe_free(path)}): "
                "records are held in memory, a failed checkpoint is removed and retried at its next "
                "interval; the job stops if nothing can be written by the end of the next step"
            )
            with self._lock:
                self._queued.append({"path": str(path), "error": str(error), "free_bytes": free_bytes(path)})

    def recovered(self, path: Path) -> None:
        with self._lock:
            was = self.failing.pop(path, None)
            over = was is not None and not self.failing
            if over:  # a spell that ended (a failed checkpoint removed) is not counted on
                self._boundaries_failing = 0
        if over:
            self._warn(f"the run directory takes writes again ({describe_free(path)})")

    def flush(self) -> None:
        """Write what the writers hold, where the disk takes it now."""
        for retry in list(self.retries):
            with contextlib.suppress(OSError):
                retry()

    def check(self) -> None:
        """At a step boundary: raise `DiskFull` if writes failed at this boundary and the last."""
        with self._lock:
            queued, self._queued = self._queued, []
        for fields in queued if self._event is not None else ():
            self._event("disk_full", **fields)  # (held by the event log while the disk is full)
        self.flush()
        with self._lock:
            failing = next(iter(self.failing.items()), None)
        if failing is None:
            self._boundaries_failing = 0
            return
        self._boundaries_failing += 1
        if self._boundaries_failing >= 2:
            raise DiskFull(*failing)


class Reserve:
    """A few MB held in the run directory from the start, given back when the disk is full so
    that the job's last records fit (where even that does not fit, none: the records are small)."""

    NAME = ".rlinf-reserve"

    def __init__(self, directory: Path, size: int = 4 << 20) -> None:
        """``size`` bytes, or an eighth of the free space where that is less."""
        self.path = directory / self.NAME
        free = free_bytes(directory)
        size = min(size, free // 8) if free is not None else size
        try:
            with self.path.open("wb") as out:
                out.write(b"\0" * size)  # real blocks (a sparse file would hold nothing)
        except OSError:
            with contextlib.suppress(OSError):
                self.path.unlink()

    def release(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()


_WATCH: list[DiskWatch] = []


def watch() -> DiskWatch:
    """This process's `DiskWatch` (the job runner binds its events on rank 0)."""
    if not _WATCH:
        from rlinf_hpc.log import get_logger

        _WATCH.append(DiskWatch(get_logger("disk").warning))
    return _WATCH[0]


class AppendFile:
    """A JSONL file appended one record at a time (``O_APPEND``, one ``write`` per record, so a
    reader sees whole lines). Bytes the disk refused are held, in order, up to ``limit``, and
    written before the next record once it takes writes again (`flush`); a partial write is
    completed, never repeated."""

    def __init__(self, path: Path, truncate: bool = False, limit: int = 64 << 20) -> None:
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
        self._fd: int | None = os.open(path, flags, 0o644)
        self._held: list[bytes] = []
        self._held_bytes = 0
        self.limit = limit
        self.dropped = 0
        self._lock = threading.Lock()
        watch().retries.append(self.flush)

    def write(self, text: str) -> None:
        data = text.encode("utf-8")
        with self._lock:
            if self._held_bytes + len(data) > self.limit:
                self.dropped += 1  # past the limit: the newest records are lost, counted
            else:
                self._held.append(data)
                self._held_bytes += len(data)
            self._flush()

    def flush(self) -> None:
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        was_failing = self.path in watch().failing
        while self._held and self._fd is not None:
            data = self._held[0]
            try:
                written = os.write(self._fd, data)
            except OSError as exc:
                if not is_disk_error(exc):
                    raise
                watch().report(self.path, exc)
                return
            self._held_bytes -= written
            if written < len(data):
                self._held[0] = data[written:]
            else:
                self._held.pop(0)
        if was_failing:
            watch().recovered(self.path)

    def close(self) -> None:
        with self._lock:
            with contextlib.suppress(OSError):
                self._flush()
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        with contextlib.suppress(ValueError):
            watch().retries.remove(self.flush)
