"""The coordinator's checkpoint manager: when to save, the two-phase save, exact resume.

A flow opts in with three calls (math_grpo does)::

    checkpoints = checkpoints_of(coordinator)
    state = checkpoints.restore([pipeline])          # None on a fresh start
    for step in range(start, steps):
        ...                                         # one step; channels are empty after it
        checkpoints.step_finished(step + 1, lambda: flow_state, [pipeline], step_seconds)
    checkpoints.finish(steps, lambda: flow_state, [pipeline])

Workers contribute through `Worker.state_dict` / `load_state_dict`; pipelines through their
own ``state_dict`` (elastic sizes, ``auto``'s measurements and decision). `step_finished` saves
every ``checkpoint.every_steps`` / ``every_minutes``, and saves then raises `CheckpointStop`
when SIGUSR2 arrived or the SLURM allocation's end is near (elapsed + slowest step + measured
save time + margin). Saves are asynchronous: training waits only for the host copies; the
commit (manifest + rename) happens at a later step boundary once every rank has written.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlinf_hpc.cluster.allocation import Allocation, can_requeue, kill_wait_s
from rlinf_hpc.config import Config
from rlinf_hpc.errors import (
    CheckpointStop,
    UserError,
    WorkerError,
)
from rlinf_hpc.log import get_logger
from rlinf_hpc.runtime import disk
from rlinf_hpc.runtime.checkpoint.files import BackgroundWrite, file_name, read_state
from rlinf_hpc.runtime.checkpoint.requeue import exit_code_after_stop
from rlinf_hpc.runtime.checkpoint.resume import check_fits, find_resume_target
from rlinf_hpc.runtime.checkpoint.room import check_room, manifest_bytes, room_error
from rlinf_hpc.runtime.checkpoint.state import capture_rng, host_copy, restore_rng
from rlinf_hpc.runtime.checkpoint.store import (
    Checkpoint,
    CheckpointStore,
    config_hash,
)
from rlinf_hpc.runtime.disk import DISK_ERRNOS, describe_free, free_bytes, is_disk_error
from rlinf_hpc.runtime.signals import stop_requested

log = get_logger("checkpoint")

COORDINATOR_FILE = "coordinator"


@dataclass
class _Pending:
    """A save whose files are still being written."""

    step: int
    reason: str
    staging: Path
    started: float
    stall_s: float
    coordinator_write: BackgroundWrite
    groups: dict[str, list[int]]
    replicated: dict[str, bool]
    waiting: set[str]
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    reshardable: dict[str, bool] = field(default_factory=dict)


class CheckpointManager:
    """Checkpoints of one job (rank 0). Disabled (every call a no-op) without a directory."""

    def __init__(
        self,
        config: Config,
        run_dir: Path | None,
        resume: str = "auto",
        force: bool = False,
        allocation: Allocation | None = None,
    ) -> None:
        self.config = config
        self.settings = config.checkpoint
        root = Path(self.settings.dir).expanduser() if self.settings.dir else None
        if root is None and run_dir is not None:
            root = run_dir / "checkpoints"
        self.enabled = self.settings.enabled and root is not None
        self.store = CheckpointStore(root, self.settings.keep) if root is not None else None
        self.resume_mode = resume
        self.force = force
        self.allocation = allocation
        self.coordinator: Any = None
        self.target: Checkpoint | None = None
        self.resumed_step = 0
        self._pending: _Pending | None = None
        self._last_save = time.monotonic()
        self._slowest_step = 0.0
        self._save_s = 0.0
        self._size = 0  # bytes of a checkpoint: estimated at the start, then measured
        self.saved: list[dict[str, Any]] = []

    # -- start -------------------------------------------------------------------------------
    def open(self) -> None:
        """Before any worker starts: take the directory, find what to resume from and check
        it fits this config (`UserError` otherwise)."""
        if not self.enabled:
            if self.resume_mode not in ("auto", "never"):
                raise UserError(
                    f"--resume {self.resume_mode}: checkpoints are off for this run (no --run-dir "
                    "and no checkpoint.dir, or checkpoint.enabled = false); give a run directory "
                    "and keep checkpoints enabled to resume."
                )
            return
        assert self.store is not None
        self.store.acquire(self.allocation.job_id if self.allocation else None)
        if self.allocation is not None and self.settings.requeue and not can_requeue():
            log.warning(
                "inside SLURM job %s but scontrol is not available: after a deadline save the job "
                "cannot requeue itself; chain jobs with `sbatch --dependency=singleton` instead "
                "(README, Long jobs)", self.allocation.job_id,
            )  # fmt: skip
        grace = self.settings.sigterm_save_s
        kill_wait = kill_wait_s() if self.allocation is not None and grace > 0 else None
        if kill_wait is not None and grace >= kill_wait:
            log.warning(
                "checkpoint.sigterm_save_s = %g s is not under this cluster's KillWait (%g s): a "
                "scancel's SIGKILL may come before the save (a preemption's GraceTime may be "
                "longer); lower it below %g s less a save's time", grace, kill_wait, kill_wait,
            )  # fmt: skip
        self.target = find_resume_target(self.store, self.resume_mode)
        self.store.remove_unfinished()  # (``never`` moved them aside with the rest)
        if self.target is not None:
            check_fits(self.target, self.config, self.force)
            self._size = manifest_bytes(self.target.manifest)
            check_room(
                self.store.root, self._size, self.settings.keep, f"the size of {self.target.path.name}"
            )

    # -- resume ------------------------------------------------------------------------------
    def restore(self, pipelines: Sequence[Any] = ()) -> dict[str, Any] | None:
        """Load the checkpoint chosen at start into every worker and the pipelines; returns the
        flow's state, or None on a fresh start."""
        if self.target is None:
            if not self.enabled and self.settings.enabled:  # said once, by flows that checkpoint
                log.info("checkpoints off: no --run-dir and no checkpoint.dir")
            elif self.enabled:  # before the first step: is there room for what will be saved?
                self._size = self._estimate_size()
                check_room(
                    self.store.root, self._size, self.settings.keep, "estimated from the workers' state"
                )
            return None
        coordinator = self.coordinator
        checkpoint = self.target
        saved = read_state(checkpoint.path, COORDINATOR_FILE)
        self._check_world(checkpoint, saved["groups"])
        for pipeline, state in zip(pipelines, saved["pipelines"], strict=False):
            pipeline.load_state_dict(state)
        groups = {name: list(ranks) for name, ranks in saved["groups"].items()}
        if groups != coordinator.placement.groups and self.config.placement.mode == "auto":
            coordinator.repartition(groups)  # auto had decided: take its placement back
        started = time.monotonic()
        futures = [
            coordinator.group(name).call("checkpoint_load", str(checkpoint.path))
            for name in coordinator.placement.groups
        ]
        for future in futures:
            future.result()
        restore_rng(saved["rng"])
        self.resumed_step = checkpoint.step
        self._last_save = time.monotonic()
        log.info(
            "resumed from %s (step %d, saved for: %s) in %.2f s",
            checkpoint.path, checkpoint.step, checkpoint.manifest.get("reason"), time.monotonic() - started,
        )  # fmt: skip
        coordinator.record("checkpoint_resumed", path=str(checkpoint.path), step=checkpoint.step)
        return saved["flow"]

    def _estimate_size(self) -> int:
        """Bytes a checkpoint of this job will take, from every worker's state now."""
        groups = self.coordinator.placement.groups
        futures = [self.coordinator.group(name).call("state_nbytes") for name in groups]
        return sum(sum(future.result()) for future in futures)

    def _check_world(self, checkpoint: Checkpoint, saved_groups: dict[str, list[int]]) -> None:
        current = self.coordinator.placement.groups
        for name, info in checkpoint.manifest["components"].items():
            now = len(current.get(name, []))
            if info["ranks"] == now:
                continue
            if info.get("reshardable"):
                log.info(
                    "component '%s' had %d rank(s), now %d: its sharded state is re-sharded by "
                    "torch.distributed.checkpoint; ranks without a saved RNG state start fresh",
                    name, info["ranks"], now,
                )  # fmt: skip
                continue
            if not info["replicated"]:
                raise UserError(
                    f"checkpoint {checkpoint.path} holds per-rank state of component '{name}' for "
                    f"{info['ranks']} rank(s); this job gives it {now}, and that state cannot be "
                    f"re-split (e.g. DeepSpeed ZeRO partitions). Resume with {info['ranks']} rank(s) "
                    f"for '{name}'."
                )
            if self.config.placement.mode != "auto":
                log.warning(
                    "component '%s' had %d rank(s), now %d: its replicated state is loaded on every "
                    "rank, but ranks without a saved RNG state start fresh (not bitwise exact)",
                    name, info["ranks"], now,
                )  # fmt: skip

    # -- saving ------------------------------------------------------------------------------
    def step_finished(
        self,
        step: int,
        state: Callable[[], dict[str, Any]],
        pipelines: Sequence[Any] = (),
        step_seconds: float = 0.0,
    ) -> None:
        """Called after step ``step`` (1-based) finished; saves when due, raises
        `CheckpointStop` after a save the job must stop for."""
        if not self.enabled:
            return
        self._slowest_step = max(self._slowest_step, step_seconds)
        reason = self._stop_reason()
        if reason is not None:
            path = self._save(step, reason, state, pipelines, wait=True)
            raise CheckpointStop(reason, step, str(path), progressed=step > self.resumed_step)
        every, minutes = self.settings.every_steps, self.settings.every_minutes
        if (every and step % every == 0) or (minutes and time.monotonic() - self._last_save >= 60 * minutes):
            self._save(step, "periodic", state, pipelines, wait=not self.settings.async_save)
        else:
            self._finish_pending(wait=False)

    def finish(self, step: int, state: Callable[[], dict[str, Any]], pipelines: Sequence[Any] = ()) -> None:
        """After the last step: the final save (``at_end``), committed before returning."""
        if not self.enabled:
            return
        saved_last = bool(self.saved) and self.saved[-1]["step"] == step
        resumed_at_end = self.target is not None and self.resumed_step == step
        if self.settings.at_end and not (saved_last or resumed_at_end):
            if self._pending is not None and self._pending.step == step:
                self._pending.reason = "end"  # it is the final save now: its failure fails the job
                self._finish_pending(wait=True)
            else:
                self._save(step, "end", state, pipelines, wait=True)
        self._finish_pending(wait=True)

    def close(self) -> None:
        """The job ends (however it ends): release the directory's lock. A save still in flight
        stays a ``step-N.tmp`` that the next run skips; `finish` is what waits for the last one."""
        if self.store is not None and self.enabled:
            if self._pending is not None and disk.watch().failing:  # room for the last records
                self.store.discard(self._pending.staging)
            self.store.release()

    def _stop_reason(self) -> str | None:
        signal_name = stop_requested()
        if signal_name is not None:
            return f"signal {signal_name}" if signal_name.startswith("SIG") else signal_name
        allocation = self.allocation
        left = allocation.seconds_left() if allocation is not None else None
        if left is not None:
            needed = self._slowest_step + self._save_s + self.settings.deadline_margin_s
            if left <= needed:
                return (
                    f"allocation deadline ({left:.1f} s left; the next step and a save need {needed:.1f} s)"
                )
        return None

    def _save(
        self,
        step: int,
        reason: str,
        state: Callable[[], dict[str, Any]],
        pipelines: Sequence[Any],
        wait: bool,
    ) -> Path | None:
        """Save step ``step``: the committed folder (``wait``), the staging folder (in
        flight), or None if it failed (`_failed`)."""
        assert self.store is not None
        self._finish_pending(wait=True)
        coordinator = self.coordinator
        busy = coordinator.calls_in_flight()
        if busy:  # then a channel may hold items, or a worker change its state while we save
            raise RuntimeError(
                f"checkpoint at step {step} while worker calls are in flight ({'; '.join(busy[:4])}): "
                "save at a step boundary, after every call of the step has returned"
            )
        started = time.monotonic()
        full = room_error(self.store.root, self._size) if reason == "periodic" else None
        if full is not None:  # it would fill the disk, and every record of the run, then fail
            return self._failed(step, reason, None, full)
        try:
            staging = self.store.staging(step)
        except OSError as exc:  # a full disk: not even the folder
            return self._failed(step, reason, None, exc)
        groups = {name: list(ranks) for name, ranks in coordinator.placement.groups.items()}
        asynchronous = self.settings.async_save and not wait
        futures = {
            name: coordinator.group(name).call("checkpoint_save", str(staging), asynchronous)
            for name in groups
        }
        own = host_copy(
            {
                "flow": state(),
                "pipelines": [p.state_dict() for p in pipelines],
                "rng": capture_rng(),
                "groups": groups,
            }
        )
        answers, error = _every_reply(futures)
        if error is not None:
            return self._failed(step, reason, staging, error)
        replicated = {name: all(r["replicated"] for r in replies) for name, replies in answers.items()}
        reshardable = {
            name: all(r.get("reshardable", False) for r in replies) for name, replies in answers.items()
        }
        stall = time.monotonic() - started
        write = BackgroundWrite(staging, COORDINATOR_FILE, own, asynchronous)
        self._pending = _Pending(
            step,
            reason,
            staging,
            started,
            stall,
            write,
            groups,
            replicated,
            set(groups),
            reshardable=reshardable,
        )
        self._last_save = time.monotonic()
        if wait:
            return self._finish_pending(wait=True) or staging
        return staging

    def _finish_pending(self, wait: bool) -> Path | None:
        """Commit the save in flight once every rank wrote its files (or, with ``wait``, after
        waiting for them). A failed save is discarded; the previous checkpoint stays."""
        pending = self._pending
        if pending is None:
            return None
        polls = {
            name: self.coordinator.group(name).call("checkpoint_poll", wait)
            for name in sorted(pending.waiting)
        }  # every group at once: one round trip, not one per group
        answers, error = _every_reply(polls)
        for name, replies in answers.items():
            for records in replies:  # a rank reports its files once: keep them at once
                for record in records or []:
                    pending.files[record["name"]] = record
            if all(r is not None for r in replies):
                pending.waiting.discard(name)
        if error is not None:
            self._pending = None
            return self._failed(pending.step, pending.reason, pending.staging, error)
        if pending.waiting or not pending.coordinator_write.done(wait):
            return None
        if pending.coordinator_write.error is not None:
            self._pending = None
            return self._failed(
                pending.step, pending.reason, pending.staging, pending.coordinator_write.error
            )
        for record in pending.coordinator_write.records or []:
            pending.files[record["name"]] = record
        self._pending = None
        try:
            return self._commit(pending)
        except OSError as exc:  # the manifest or the rename, on a full disk
            return self._failed(pending.step, pending.reason, pending.staging, exc)

    def _failed(self, step: int, reason: str, staging: Path | None, exc: BaseException) -> None:
        """A save that failed (or, ``staging`` None, was not started: no room): its partial
        folder removed, the previous checkpoint kept. A periodic one is retried at the next
        interval; any other (the last, before a stop) fails the job — `disk.DiskFull` when the
        disk is what failed it."""
        assert self.store is not None
        if staging is not None:
            self.store.discard(staging)
            disk.watch().flush()  # the records held while it filled the disk go out now
        newest = self.saved[-1]["path"] if self.saved else "none yet"
        text = str(exc)  # a worker's OSError arrives as its text
        full = is_disk_error(exc) or any(os.strerror(code) in text for code in DISK_ERRNOS)
        what = "failed" if staging is not None else "not started"
        removed = "; its partial folder is removed" if staging is not None else ""
        log.error(
            "checkpoint of step %d %s (%s; %s in %s)%s; the newest complete checkpoint (%s) is intact%s",
            step, what, exc, describe_free(self.store.root), self.store.root, removed, newest,
            "; the next is tried at the next interval" if reason == "periodic" else "",
        )  # fmt: skip
        self.coordinator.record(
            "checkpoint_failed", step=step, error=text, newest=newest, disk_full=full,
            free_bytes=free_bytes(self.store.root),
        )  # fmt: skip
        if reason == "periodic":
            return None
        if full:
            error = exc if isinstance(exc, OSError) else OSError(errno.ENOSPC, text)
            raise disk.DiskFull(self.store.root, error) from exc
        raise exc

    def _commit(self, pending: _Pending) -> Path:
        assert self.store is not None
        expected = {f"{COORDINATOR_FILE}.{ext}" for ext in ("json", "safetensors")} | {
            f"{file_name(name, g)}.{ext}"
            for name, ranks in pending.groups.items()
            for g in range(len(ranks))
            for ext in ("json", "safetensors")
        }
        if expected - pending.files.keys():  # a manifest must vouch for every file of the save
            raise RuntimeError(
                f"checkpoint of step {pending.step}: no record of {sorted(expected - pending.files.keys())}"
            )
        config = self.config.model_dump(mode="json")
        manifest = {
            "step": pending.step,
            "reason": pending.reason,
            "world": {"size": len(self.coordinator.worker_ranks) + 1, "groups": pending.groups},
            "components": {
                name: {
                    "ranks": len(ranks),
                    "replicated": pending.replicated[name],
                    "reshardable": pending.reshardable.get(name, False),
                }
                for name, ranks in pending.groups.items()
            },
            "config_hash": config_hash(config),
            "config": config,
            "job": {
                "slurm_job_id": self.allocation.job_id if self.allocation else None,
                "host": socket.gethostname(),
            },
            "stall_s": round(pending.stall_s, 6),
            "files": {
                name: {k: r[k] for k in ("size", "sha256")} for name, r in sorted(pending.files.items())
            },
        }
        path = self.store.commit(pending.staging, manifest)
        seconds = time.monotonic() - pending.started
        self._save_s = max(self._save_s, seconds)
        size = sum(r["size"] for r in pending.files.values())
        if not self.saved and size > 1.5 * self._size:  # the estimate fell short: say so now
            check_room(self.store.root, size, self.settings.keep, "measured by the first save", refuse=False)
        self._size = size
        entry = {
            "step": pending.step, "reason": pending.reason, "path": str(path), "seconds": round(seconds, 4),
            "stall_s": round(pending.stall_s, 4), "bytes": size,
        }  # fmt: skip
        self.saved.append(entry)
        log.info(
            "checkpoint step %d (%s): %.1f MB in %.2f s (training stalled %.3f s) -> %s",
            pending.step, pending.reason, size / 1e6, seconds, pending.stall_s, path,
        )  # fmt: skip
        self.coordinator.record("checkpoint_saved", **entry)
        return path

    # -- after a stop ------------------------------------------------------------------------
    def exit_code_after_stop(self, stop: CheckpointStop) -> int:
        """Requeue in SLURM when that is right (`requeue.exit_code_after_stop`); returns the
        job's exit code."""
        assert self.store is not None
        return exit_code_after_stop(stop, self.allocation, self.settings, self.store.root)


def _every_reply(futures: dict[str, Any]) -> tuple[dict[str, list[Any]], WorkerError | None]:
    """Each group's replies and the first error: every future is collected, failed or not, so
    none is left in flight for the next save."""
    answers, error = {}, None
    for name, future in futures.items():
        try:
            answers[name] = future.result()
        except WorkerError as exc:
            error = error or exc
    return answers, error


def checkpoints_of(coordinator: Any) -> CheckpointManager:
    """The job's checkpoint manager (a disabled one when the flow runs outside `rlinf-hpc run`)."""
    manager = getattr(coordinator, "checkpoints", None)
    if manager is None:
        manager = CheckpointManager(coordinator.config, None)
        manager.enabled = False
        manager.coordinator = coordinator
        coordinator.checkpoints = manager
    return manager
