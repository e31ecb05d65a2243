"""[checkpoint]: when a long job saves, where, how many it keeps, and what it does near the end
of its SLURM allocation (see README, Long jobs)."""

from __future__ import annotations

from pydantic import Field

from rlinf_hpc.config.section import Section as _Section


class CheckpointConfig(_Section):
    """[checkpoint]: periodic, deadline-aware saves and exact resume (see README "Long jobs")."""

    enabled: bool = Field(
        True,
        description="Save checkpoints (flows that support them: math_grpo). Needs --run-dir or "
        "checkpoint.dir; without either the job says so once and saves nothing.",
    )
    dir: str = Field(
        "", description="Where checkpoints go (default RUN_DIR/checkpoints); one job per directory."
    )
    every_steps: int = Field(20, ge=0, description="Save every N finished steps (0: off).")
    every_minutes: float = Field(
        30.0, ge=0, description="Save when this many minutes passed since the last save (0: off)."
    )
    keep: int = Field(
        2, ge=2, description="Complete checkpoints kept (the newest complete one is never deleted)."
    )
    async_save: bool = Field(
        True,
        description="Training stalls only for the copy to host memory; files are written and "
        "hashed in the background (the next save waits for the previous one).",
    )
    at_end: bool = Field(True, description="Save after the last step.")
    deadline_margin_s: float = Field(
        60.0,
        ge=0,
        description="Inside SLURM: save and stop when elapsed + slowest step + measured save "
        "time + this margin would pass the allocation's end.",
    )
    signal_seconds: int = Field(
        120, ge=10, description="`rlinf-hpc submit`: ask SLURM for SIGUSR2 this many seconds before the end."
    )
    sigterm_save_s: float = Field(
        0.0,
        ge=0,
        le=3600,
        description="On a first SIGTERM (scancel; a preemption's notice where SLURM does not "
        "send the job's own signal) go on to the next step boundary, save it and stop (exit 3, "
        "never requeued from the job) if it comes within this many seconds, else stop as "
        "without it; a second SIGTERM stops at once. 0: stop at once. Keep it under SLURM's "
        "KillWait (30 s by default) or the partition's GraceTime, less a save's time. A flow "
        "that saves no checkpoints (emulated_rl, the examples) stops when the grace ends.",
    )
    requeue: bool = Field(
        True, description="Inside SLURM: after a deadline/signal save, `scontrol requeue` the job."
    )
    max_requeues: int = Field(
        3, ge=0, description="Requeues after a *timeout* (preemptions do not count) before stopping."
    )
