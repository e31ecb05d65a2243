"""Which accelerators this rank can see, asked of NVML without importing torch.

Importing torch costs seconds per rank on a busy node; NVML answers in milliseconds and also
tells the watchdog's GPU checks whether they can run.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GpuProbe:
    """Visible GPUs on this rank and how we learned it."""

    num_visible: int
    names: list[str] = field(default_factory=list)
    nvml_status: str = "unavailable"
    driver_version: str | None = None


def _visible_indices(num_physical: int, env: Mapping[str, str]) -> list[int]:
    """Indices allowed by CUDA_VISIBLE_DEVICES (numeric ids; UUID entries count as visible)."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return list(range(num_physical))
    entries = [e.strip() for e in raw.split(",") if e.strip()]
    visible: list[int] = []
    for entry in entries:
        if entry.lstrip("-").isdigit():
            index = int(entry)
            if index < 0 or index >= num_physical:
                break  # CUDA stops at the first invalid id
            visible.append(index)
        else:
            visible.append(len(visible))  # UUID/MIG ids: trust them, map in order
    return visible


def probe_gpus(env: Mapping[str, str] | None = None) -> GpuProbe:
    """Ask NVML for the GPUs this process can use; no NVML library means no GPU."""
    env = os.environ if env is None else env
    try:
        import pynvml
    except ImportError:
        return GpuProbe(0, nvml_status="nvidia-ml-py not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return GpuProbe(0, nvml_status=f"off ({exc})")
    try:
        count = pynvml.nvmlDeviceGetCount()
        indices = _visible_indices(count, env)
        names = []
        for index in indices:
            if index < count:
                name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(index))
                names.append(name.decode() if isinstance(name, bytes) else str(name))
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
        return GpuProbe(len(indices), names, "ok", driver)
    except pynvml.NVMLError as exc:
        return GpuProbe(0, nvml_status=f"error ({exc})")
    finally:
        pynvml.nvmlShutdown()
