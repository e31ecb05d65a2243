"""How a run ended, said once: its culprit, and who writes the ``end`` event.

One failure can be named from several places, in any order, each of which may be killed the
next moment: the coordinator's main thread (an error a call returned, a signal), its watchdog
thread (a stopped or dead rank), the death watch helper (a rank killed outright), rank 1 (a dead
coordinator). The first to *claim* names the culprit: a claim is written complete under a
private name and hard-linked into place (``link`` fails when the name exists), so exactly one
writer wins on any POSIX filesystem and no reader sees half a record. Every later account —
``summary.json``, the ``end`` event, the console's last line — is read from the claim, so nothing
written afterwards can name another rank. Within one process a claim also holds when the disk
refuses the file (a full run directory): the first in-process claimant wins.

The claims live in ``RUN_DIR/heartbeats/`` and carry the run id; `clear` removes a previous
run's at the start of a run.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["CULPRIT", "END", "claim_culprit", "claim_end", "claimed_culprit", "clear", "culprit_record"]

CULPRIT = "culprit.json"
END = "end.json"
_DIR = "heartbeats"

_lock = threading.Lock()
#: Claims made by this process: ``{path: record}`` (they hold when the file could not be written).
_mine: dict[str, dict[str, Any]] = {}


def _read(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _claim(path: Path, record: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    """``(won, the record in force)`` for a claim of ``path``."""
    with _lock:
        if str(path) in _mine:
            return False, _mine[str(path)]
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(record, default=str), encoding="utf-8")
            os.link(tmp, path)
        except FileExistsError:
            theirs = _read(path)
            if theirs is not None and theirs.get("run_id") == record.get("run_id"):
                return False, theirs
            # another run's claim left behind (`clear` removes them): this run's is the first
            with contextlib.suppress(OSError):
                tmp.replace(path)
        except OSError:
            pass  # a full or read-only disk: the claim holds in this process
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        _mine[str(path)] = record
        return True, record


def culprit_record(
    rank: int | None,
    component: str | None,
    cause: str,
    error: str,
    host: str | None = None,
    **more: Any,
) -> dict[str, Any]:
    """A culprit as every account spells it: who (rank, component, host) and why (``cause``: one
    word — died, crash, oom_kill, stopped, stuck, signal, exception, timeout, disk_full,
    configuration, gpu — and ``error``: the sentence)."""
    return {"rank": rank, "component": component, "host": host, "cause": cause, "error": error, **more}


def claim_culprit(
    run_dir: Path, run_id: str, outcome: str, culprit: dict[str, Any]
) -> tuple[bool, str, dict[str, Any]]:
    """Name ``culprit`` as why this run ended, unless one was named first: ``(won, outcome,
    culprit)`` with the outcome and culprit in force."""
    record = {"run_id": run_id, "time": round(time.time(), 6), "outcome": outcome, "culprit": culprit}
    won, held = _claim(run_dir / _DIR / CULPRIT, record)
    return won, held["outcome"], held["culprit"]


def claimed_culprit(run_dir: Path, run_id: str) -> tuple[str, dict[str, Any]] | None:
    """``(outcome, culprit)`` this run's first claim named, else None."""
    path = run_dir / _DIR / CULPRIT
    with _lock:
        held = _mine.get(str(path))
    held = held or _read(path)
    if held is None or held.get("run_id") != run_id:
        return None
    return held["outcome"], held["culprit"]


def claim_end(run_dir: Path, run_id: str, writer: str) -> bool:
    """True for the one caller (``writer``: who) that is to write this run's ``end`` event."""
    won, _ = _claim(run_dir / _DIR / END, {"run_id": run_id, "writer": writer, "time": time.time()})
    return won


def clear(run_dir: Path) -> None:
    """Remove a previous run's claims (the start of a run, before any rank works)."""
    for name in (CULPRIT, END):
        with contextlib.suppress(OSError):
            (run_dir / _DIR / name).unlink()
    with _lock:
        for name in (CULPRIT, END):
            _mine.pop(str(run_dir / _DIR / name), None)
