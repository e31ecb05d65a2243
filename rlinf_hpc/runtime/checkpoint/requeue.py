"""After a save the job had to stop for: requeue it in SLURM, or say why not.

Timeouts count against ``checkpoint.max_requeues``, preemptions do not (the counts live in
``CHECKPOINT_DIR/requeues.json``, as the requeued run is a new process); a run that made no
progress since it resumed stops instead of looping. The exit codes are in `rlinf_hpc.errors`.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlinf_hpc.cluster.allocation import Allocation, can_requeue, requeue_after_exit
from rlinf_hpc.config.checkpoint import CheckpointConfig
from rlinf_hpc.errors import EXIT_NO_PROGRESS, EXIT_REQUEUED, EXIT_SAVED_AND_STOPPED, CheckpointStop
from rlinf_hpc.log import get_logger

log = get_logger("checkpoint")


def exit_code_after_stop(
    stop: CheckpointStop, allocation: Allocation | None, settings: CheckpointConfig, root: Path
) -> int:
    """Requeue when that is right (deferred until MPI is finalized); returns the exit code."""
    if not stop.progressed:
        log.error(
            "stopped at step %d, where this run resumed: no progress since the last run, so the "
            "job does not requeue (a step plus a save may not fit the time left; give the job "
            "more time or lower checkpoint.deadline_margin_s)", stop.step,
        )  # fmt: skip
        return EXIT_NO_PROGRESS
    if allocation is None or not settings.requeue or stop.reason == "signal SIGTERM":
        # a SIGTERM (`checkpoint.sigterm_save_s`) is scancel's, or a preemption's that SLURM
        # requeues itself: never requeued from here
        log.warning(
            "saved step %d and stopped (%s); run the same command again to resume", stop.step, stop.reason
        )
        return EXIT_SAVED_AND_STOPPED
    if not can_requeue():
        log.warning("saved step %d; scontrol is not available, so the job does not requeue", stop.step)
        return EXIT_SAVED_AND_STOPPED
    timeout = stop.reason.startswith("allocation deadline") or allocation.timed_out()
    counts = _requeue_counts(root)
    if timeout:
        if counts["timeouts"] >= settings.max_requeues:
            log.error(
                "saved step %d; the job timed out %d time(s) already (checkpoint.max_requeues = "
                "%d): not requeueing again", stop.step, counts["timeouts"], settings.max_requeues,
            )  # fmt: skip
            return EXIT_NO_PROGRESS
        counts["timeouts"] += 1
    else:
        counts["preemptions"] += 1
    _write_requeue_counts(root, counts)
    requeue_after_exit(allocation.job_id)
    log.warning(
        "saved step %d; requeueing SLURM job %s (%s; timeouts %d/%d, preemptions %d)",
        stop.step, allocation.job_id, "timeout" if timeout else "preemption", counts["timeouts"],
        settings.max_requeues, counts["preemptions"],
    )  # fmt: skip
    return EXIT_REQUEUED


def _requeue_counts(root: Path) -> dict[str, int]:
    try:
        return {"timeouts": 0, "preemptions": 0, **json.loads((root / "requeues.json").read_text())}
    except (OSError, json.JSONDecodeError):
        return {"timeouts": 0, "preemptions": 0}


def _write_requeue_counts(root: Path, counts: dict[str, int]) -> None:
    (root / "requeues.json").write_text(json.dumps(counts), encoding="utf-8")
