"""Where checkpoints live and which of them can be trusted.

``step-N.tmp/`` is written by every rank; when all confirmed, rank 0 writes ``manifest.json``
(each file's size and sha256, the world layout, the config and its hash, the package version)
and renames the directory to ``step-N/`` — the commit. A checkpoint is *complete* when its
manifest exists and every file matches it. `newest_complete` skips partial, corrupt and foreign
ones with one warning each. ``LOCK`` names the job that owns the directory.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import threading
import time
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from rlinf_hpc import __version__
from rlinf_hpc.config.apps import resolve_app, runner_of
from rlinf_hpc.errors import UserError
from rlinf_hpc.log import get_logger
from rlinf_hpc.runtime.checkpoint.files import file_digest, fsync_path, write_durable
from rlinf_hpc.runtime.ownership import DirectoryLock
from rlinf_hpc.runtime.rundir import make_writable_dir

log = get_logger("checkpoint")

MANIFEST = "manifest.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")

#: Framework config keys that may change between a run and its resume without harm (rank
#: counts are checked against the checkpoint's world layout instead: replicated state loads on
#: any). An app adds its own (`App.resumable_keys`, e.g. the math app's ``grpo.steps``).
RESUMABLE_KEYS = (
    "checkpoint.", "watchdog.", "job.log_level", "job.call_timeout_s", "job.shutdown_timeout_s",
    "job.num_ranks", "comm.verify", "components.*.num_ranks", "components.*.ranks",
)  # fmt: skip
#: Keys no resume may change, not even a forced one: the state would not fit or not mean the
#: same. An app adds its own (`App.fixed_keys`, e.g. the math app's ``model.``).
FIXED_KEYS = ("flow.runner",)


def key_patterns(config: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(resumable, fixed)`` key patterns for a config dict: the framework's and its app's."""
    app = resolve_app(runner_of(config))
    return RESUMABLE_KEYS + app.resumable_keys, FIXED_KEYS + app.fixed_keys


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a.b": value}`` for every leaf (components' tables keep their dotted names)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out |= flat_config(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) or fnmatchcase(key, p) for p in patterns)


def config_hash(config: dict[str, Any]) -> str:
    """sha256 of the config without the keys a resume may change."""
    resumable, _ = key_patterns(config)
    kept = {k: v for k, v in flat_config(config).items() if not _matches(k, resumable)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(changed, fixed)``: keys whose values differ (ignoring resumable ones), and those of
    them no resume may change."""
    resumable, fixed = key_patterns(current)
    old, new = flat_config(saved), flat_config(current)
    changed = sorted(
        k for k in old.keys() | new.keys() if old.get(k) != new.get(k) and not _matches(k, resumable)
    )
    return changed, [k for k in changed if _matches(k, fixed)]


def describe_differences(saved: dict[str, Any], current: dict[str, Any], keys: list[str]) -> str:
    old, new = flat_config(saved), flat_config(current)
    return "; ".join(f"{k}: {old.get(k, '(unset)')!r} -> {new.get(k, '(unset)')!r}" for k in keys[:12])


@dataclass
class Checkpoint:
    """A committed checkpoint directory and its manifest."""

    path: Path
    manifest: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint directory ``path``; `ValueError` says why it is not one."""
    file = path / MANIFEST
    if not file.is_file():
        raise ValueError(f"no {MANIFEST} (a save that did not finish)")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{MANIFEST} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "files" not in manifest:
        raise ValueError(f"{MANIFEST} is not an rlinf_hpc checkpoint manifest of format {FORMAT}")
    return manifest


def verify(path: Path, manifest: dict[str, Any]) -> None:
    """`ValueError` naming the first file that is missing or differs from the manifest."""
    for name, record in sorted(manifest["files"].items()):
        file = path / name
        if not file.is_file():
            raise ValueError(f"{name} is missing")
        size = file.stat().st_size
        if size != record["size"]:
            raise ValueError(f"{name} has {size} bytes, the manifest says {record['size']}")
        if file_digest(file) != record["sha256"]:
            raise ValueError(f"{name} does not match its sha256 in the manifest (corrupt)")


def open_checkpoint(path: Path) -> Checkpoint:
    """A complete checkpoint at ``path``, or `ValueError` saying why not."""
    manifest = read_manifest(path)
    verify(path, manifest)
    return Checkpoint(path, manifest)


class CheckpointStore:
    """The checkpoint directory of one job: lock, commit, retention, discovery."""

    def __init__(self, root: Path, keep: int = 2) -> None:
        self.root = root
        self.keep = keep
        self._deleting: list[threading.Thread] = []
        self._lock: DirectoryLock | None = None

    # -- ownership ---------------------------------------------------------------------------
    def acquire(self, job_id: str | None) -> None:
        """Create the directory and take its ``LOCK`` (`UserError` if it cannot be written or
        another live job holds it). A lock left by a dead process on this host, or by an
        earlier run of the same SLURM job (a requeue), is taken over."""
        try:
            make_writable_dir(self.root)
        except OSError as exc:
            raise UserError(
                f"checkpoint directory '{self.root}' cannot be written ({exc.strerror or exc}); the job "
                "would fail at its first save. Point checkpoint.dir (or --run-dir) at a writable "
                "directory, or set checkpoint.enabled = false."
            ) from None
        self._lock = DirectoryLock(
            self.root / "LOCK",
            f"checkpoint directory '{self.root}'",
            "Give this run its own --run-dir or checkpoint.dir.",
        )
        self._lock.acquire(job_id)

    def release(self) -> None:
        for thread in self._deleting:
            thread.join()
        if self._lock is not None:
            self._lock.release()

    # -- writing -----------------------------------------------------------------------------
    def staging(self, step: int) -> Path:
        """A fresh ``step-N.tmp/`` (a leftover of a crashed save is removed first)."""
        path = self.root / f"step-{step:08d}.tmp"
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        return path

    def commit(self, staging: Path, manifest: dict[str, Any]) -> Path:
        """Write the manifest and rename ``step-N.tmp`` to ``step-N``; then delete old ones in
        the background (never the newest complete one)."""
        manifest = {"format": FORMAT, "package_version": __version__, "created": time.time(), **manifest}
        write_durable(staging / MANIFEST, json.dumps(manifest, indent=1, default=str).encode())
        final = staging.with_name(staging.name.removesuffix(".tmp"))
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
        fsync_path(self.root)
        self._prune()
        return final

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def _prune(self) -> None:
        committed = self.committed()
        old = committed[: -self.keep]
        if not old:
            return
        thread = threading.Thread(
            target=lambda: [shutil.rmtree(p, ignore_errors=True) for p in old],
            name="checkpoint-prune",
            daemon=True,
        )
        thread.start()
        self._deleting = [t for t in self._deleting if t.is_alive()] + [thread]

    # -- discovery ---------------------------------------------------------------------------
    def committed(self) -> list[Path]:
        """``step-N`` directories (committed or not checked), oldest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name))]
        return [p for _, p in sorted(found)]

    def has_any(self) -> bool:
        return bool(self.committed())

    def newest_complete(self, accept: Any = None) -> Checkpoint | None:
        """The newest checkpoint whose manifest and files check out (and that ``accept``, a
        function raising `ValueError` for a foreign one, accepts); the others are skipped
        with one warning each."""
        for path in reversed(self.committed()):
            try:
                checkpoint = open_checkpoint(path)
                if accept is not None:
                    accept(checkpoint)
            except ValueError as exc:
                log.warning("skipping checkpoint %s: %s", path, exc)
                continue
            return checkpoint
        return None

    def remove_unfinished(self) -> list[Path]:
        """Remove the ``step-N.tmp`` folders of saves that did not finish (a job killed or out
        of disk while saving), each said with its size; returns them. Under the directory's lock:
        no other job is writing one."""
        removed = []
        for path in sorted(self.root.glob("step-*.tmp")):
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            log.warning("removing %s: a save that did not finish (%.1f MB)", path, size / 1e6)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        return removed
