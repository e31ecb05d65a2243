"""The run directory: chosen, checked and owned before any rank starts work.

Without ``--run-dir`` a job writes to a fresh ``runs/<job.name>-<YYYYmmdd-HHMMSS>`` (results are
never lost to a missing flag). The directory must be a directory (not a file, not under one) and
writable; a ``RUN.lock`` (`DirectoryLock`) keeps a second live job out. Each run has a run id,
on every event line and in ``summary.json``, which is replaced at the start of every run
(``outcome = "running"``) and rewritten at its end however it ends (``interrupted`` when it
did not finish) — never a previous run's.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from rlinf_hpc.errors import UserError
from rlinf_hpc.runtime import accounting
from rlinf_hpc.runtime.disk import Reserve, describe_free, is_disk_error
from rlinf_hpc.runtime.ownership import DirectoryLock

LOCK_NAME = "RUN.lock"


def default_run_dir(job_name: str, now: float | None = None) -> Path:
    """``runs/<job name>-<local time>`` (the name made safe for a path)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", job_name).strip("-") or "job"
    path = Path("runs") / f"{safe}-{stamp}"
    n = 1
    while path.exists():  # two runs started within a second
        n += 1
        path = Path("runs") / f"{safe}-{stamp}-{n}"
    return path


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def make_writable_dir(path: Path) -> None:
    """Create ``path`` (and parents) and prove a file can be written there; `OSError` if not."""
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".write-test-{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()


def check_run_dir(path: Path, flag: str = "--run-dir") -> Path:
    """Create ``path`` if needed and prove it writable; `UserError` (what, why, fix) if not."""
    if path.exists() and not path.is_dir():
        raise UserError(
            f"{flag} '{path}' is a file, not a directory: the job keeps its config, events, "
            "metrics and checkpoints in a directory. Give a directory path (it is created if "
            "missing), or move the file away."
        )
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(
            f"{flag} '{path}' lies under '{ancestor}', which is a file, so the directory cannot be "
            "created. Choose a path whose parents are directories."
        )
    try:
        make_writable_dir(path)
    except OSError as exc:
        raise UserError(
            f"{flag} '{path}' cannot be written ({exc.strerror or exc}): the job would lose its "
            "results. Give a writable directory (check permissions, quota, a read-only mount)."
        ) from None
    return path


class RunDirectory:
    """One run's directory: checked, locked, and its ``summary.json`` kept current."""

    def __init__(self, path: Path, run_id: str | None = None) -> None:
        self.path = path
        self.run_id = run_id or new_run_id()
        #: A few MB held from `open` on, given back for the last records when the disk is full.
        self.reserve: Reserve | None = None
        self._lock = DirectoryLock(
            path / LOCK_NAME,
            f"run directory '{path}'",
            "Give this run its own --run-dir (or leave the flag out for a fresh one).",
        )

    def check_free(self, job_id: str | None) -> None:
        """`UserError` if the directory is unusable or a live job holds it (takes nothing)."""
        check_run_dir(self.path)
        self._lock.refuse_if_held(job_id)

    def open(self, job_id: str | None) -> None:
        """Check, lock, and replace any earlier run's summary with this run's "running" one."""
        check_run_dir(self.path)
        try:
            self._lock.acquire(job_id, self.run_id)
            accounting.clear(self.path)
            (self.path / "heartbeats" / "exits.jsonl").unlink(missing_ok=True)  # a previous run's
            self.reserve = Reserve(self.path)
            self.write_summary({"outcome": "running", "started": time.time()})
        except OSError as exc:
            self._lock.release()
            raise UserError(
                f"run directory '{self.path}' takes no more writes ({exc.strerror or exc}; "
                f"{describe_free(self.path)}): the job could not record its events, metrics or "
                "checkpoints. Free space there, or give --run-dir on a filesystem with room."
            ) from None

    def claimed(self) -> tuple[str, dict[str, Any]] | None:
        """``(outcome, culprit)`` if this run's culprit was named (`accounting`), else None."""
        return accounting.claimed_culprit(self.path, self.run_id)

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Replace ``summary.json``; once a culprit is named, the summary of an unfinished run
        carries it (never another account of who failed)."""
        record = {"run_id": self.run_id, **summary}
        claim = self.claimed() if record.get("outcome") not in ("running", "ok") else None
        if claim is not None:
            record.update(outcome=claim[0], interrupted=True, culprit=claim[1])
        tmp = self.path / "summary.json.tmp"
        text = json.dumps(record, indent=2, default=str)
        try:
            tmp.write_text(text, encoding="utf-8")
        except OSError as exc:
            if not is_disk_error(exc) or self.reserve is None:
                raise
            self.reserve.release()  # a full disk: the reserve is there for this
            tmp.write_text(text, encoding="utf-8")
        tmp.replace(self.path / "summary.json")

    def close(self) -> None:
        if self.reserve is not None:
            self.reserve.release()
        self._lock.release()
