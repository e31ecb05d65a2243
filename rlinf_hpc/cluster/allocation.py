"""The SLURM allocation's clock: when it started, when it ends, how often it was requeued, and
the requeue itself. A checkpoint deadline is anchored here, not to process start (a step
launched late in an allocation has less time than its own uptime suggests).

End time: ``SLURM_JOB_END_TIME`` where SLURM sets it (≥ 23.02), else ``scontrol show job``.
Timeout vs preemption: a job that ran at least max(0.8 × limit, limit − 10 min) is taken to
have timed out (submitit's idea; with max rather than min, so that on a short limit a
preemption a minute in is not counted as a timeout).

The requeue itself is deferred until this rank has finalized MPI (`run_deferred_requeue`):
``scontrol requeue`` kills whatever still runs, and MPICH ranks killed mid-job leave shared-
memory segments named after the job and step id, which the requeued run (same ids) would
attach to and hang in.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass

from rlinf_hpc.log import get_logger

log = get_logger("cluster")


@dataclass(frozen=True)
class Allocation:
    """The SLURM job this process runs in (times in seconds since the epoch)."""

    job_id: str
    start: float | None
    end: float | None
    restarts: int = 0

    @property
    def limit_s(self) -> float | None:
        if self.start is None or self.end is None:
            return None
        return self.end - self.start

    def seconds_left(self, now: float | None = None) -> float | None:
        return None if self.end is None else self.end - (time.time() if now is None else now)

    def timed_out(self, now: float | None = None) -> bool:
        """Whether stopping now counts as a timeout (not a preemption)."""
        limit = self.limit_s
        if limit is None or self.start is None:
            return True  # unknown: count it, so a broken setup cannot requeue forever
        ran = (time.time() if now is None else now) - self.start
        return ran >= max(0.8 * limit, limit - 600)


_FIELD = re.compile(r"(\w+)=(\S*)")


def _epoch(text: str | None) -> float | None:
    if not text or text in ("Unknown", "None", "N/A"):
        return None
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def scontrol_job(job_id: str) -> dict[str, str]:
    """``scontrol show job -o JOB`` as a dict ({} if scontrol is missing or fails)."""
    if shutil.which("scontrol") is None:
        return {}
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(_FIELD.findall(out.stdout)) if out.returncode == 0 else {}


def kill_wait_s(config_text: str | None = None) -> float | None:
    r"""SLURM's ``KillWait`` (seconds between a job's SIGTERM and its SIGKILL), from ``scontrol
    show config`` or ``config_text``; None where it cannot be read.

    >>> kill_wait_s("KillOnBadExit           = 0\nKillWait                = 30 sec\n")
    30.0
    """
    if config_text is None:
        if shutil.which("scontrol") is None:
            return None
        try:
            out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        config_text = out.stdout if out.returncode == 0 else ""
    match = re.search(r"^KillWait\s*=\s*(\d+)", config_text, re.MULTILINE)
    return float(match.group(1)) if match else None


def read_allocation(env: Mapping[str, str] | None = None) -> Allocation | None:
    """The allocation of this SLURM job, or None outside SLURM."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None
    start = _float(env.get("SLURM_JOB_START_TIME"))
    end = _float(env.get("SLURM_JOB_END_TIME"))
    restarts = int(_float(env.get("SLURM_RESTART_COUNT")) or 0)
    if start is None or end is None:
        fields = scontrol_job(job_id)
        start = start or _epoch(fields.get("StartTime"))
        end = end or _epoch(fields.get("EndTime"))
        if fields.get("Restarts", "").isdigit():
            restarts = max(restarts, int(fields["Restarts"]))
    return Allocation(job_id, start, end, restarts)


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


def can_requeue() -> bool:
    return shutil.which("scontrol") is not None


_deferred: list[str] = []


def requeue_after_exit(job_id: str) -> None:
    """Ask for ``scontrol requeue JOB`` once this rank is done with MPI (see the module doc)."""
    _deferred.append(job_id)


def run_deferred_requeue() -> None:
    """Finalize MPI and requeue, if a requeue was asked for; SLURM then ends this run (its
    SIGTERM is ignored from here on) and starts the job again."""
    if not _deferred:
        return
    import signal

    from rlinf_hpc.comm import finalize

    finalize()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    job_id = _deferred.pop()
    result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job_id, result.stderr.strip())
