"""[watchdog]: heartbeats on every rank and the coordinator's watch over them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlinf_hpc.config.section import Section as _Section


class WatchdogConfig(_Section):
    """[watchdog]: notice a rank that stopped (SIGSTOP, a frozen process) or died, name it,
    dump every rank's Python stack into RUN_DIR/stacks/, and end the job."""

    enabled: bool = Field(True, description="Heartbeats and the watch (a sleeping thread per rank).")
    heartbeat_s: float = Field(2.0, gt=0, le=60, description="Seconds between a rank's heartbeats.")
    hang_timeout_s: float = Field(
        120.0,
        gt=0,
        description="A rank whose heartbeat is this old is reported (liveness: a long call still "
        "beats, so this is no limit on how long a call may take).",
    )
    action: Literal["abort", "warn"] = Field(
        "abort", description="`abort`: name the rank, dump stacks, end the job; `warn`: log it once."
    )

    leak_window: int = Field(
        20, ge=4, description="Pipeline steps over which memory growth is fitted (Theil–Sen slope)."
    )
    leak_mb_per_step: float = Field(2.0, gt=0, description="Growth per step that counts as a leak.")
    leak_min_growth_mb: float = Field(
        200.0, ge=0, description="... and at least this much growth over the window (MB)."
    )
    leak_action: Literal["warn", "free", "checkpoint_stop"] = Field(
        "warn",
        description="`warn`: log the rank and its rate once; `free`: also ask every component to "
        "release caches (gc, torch.cuda.empty_cache); `checkpoint_stop`: save and stop at the "
        "next step boundary.",
    )

    memory_warn_fraction: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Warn (once, until it falls back) when a memory cgroup's working set (usage "
        "less inactive file cache) or a node's memory in use reaches this share of its limit, "
        "naming the ranks holding most: before the kernel's OOM killer ends one.",
    )

    straggler_ratio: float = Field(
        1.5, gt=1, description="A rank slower per item than ratio x its stage peers' median..."
    )
    straggler_window: int = Field(
        10, ge=2, description="... in 80% of this many pipeline steps is named a straggler."
    )

    gpu_health: bool = Field(
        True,
        description="Watch the GPU of every rank that works on one through NVML (temperature, XID, "
        "ECC, remapped rows, throttling, memory); off by itself without a GPU.",
    )
    gpu_poll_s: float = Field(10.0, gt=0, description="Seconds between a rank's NVML readings.")
    gpu_temp_c: float = Field(85.0, gt=0, description="A GPU at or above this temperature (°C)...")
    gpu_temp_action: Literal["warn", "pause", "checkpoint_stop"] = Field(
        "pause",
        description="... `warn`; `pause`: its rank starts no new call until the GPU is 5 °C cooler "
        "(at most gpu_pause_max_s, then the job saves and stops); `checkpoint_stop`.",
    )
    gpu_pause_max_s: float = Field(600.0, gt=0, description="The longest a hot GPU pauses its rank.")
    gpu_fault_action: Literal["warn", "checkpoint_stop", "abort"] = Field(
        "checkpoint_stop",
        description="On a hardware fault (a critical XID other than an application's, a new "
        "double-bit ECC error, a failed row remapping): `warn`, `checkpoint_stop` (save while the "
        "GPU still answers, then stop), `abort`.",
    )

    @model_validator(mode="after")
    def _check(self) -> WatchdogConfig:
        if self.hang_timeout_s < 3 * self.heartbeat_s:
            raise ValueError(
                f"watchdog.hang_timeout_s ({self.hang_timeout_s}) must be at least 3 x "
                f"watchdog.heartbeat_s ({self.heartbeat_s}), or a busy box would raise false alarms"
            )
        return self
