"""A fake of nvidia-ml-py's ``pynvml`` for the GPU health tests: the calls rlinf_hpc makes, with
the library's error classes and constants, answering from `STATE`.

Unit tests import this file under another name and change `STATE` directly. A job sees it as
``pynvml`` when ``tests/fake_nvml`` comes first on PYTHONPATH; then ``FAKE_NVML_SCENARIO`` names a
JSON file of timed changes, ``{"gpus": 1, "t0": T, "changes": [[seconds, {"temp_c": 90}], ...]}``,
the seconds counted from ``t0`` (wall clock), so every rank of a job sees the same story. The file
is read again whenever it changes (a job's flow can start the story when its ranks are up).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

NVML_TEMPERATURE_GPU = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_ERROR_TIMEOUT = 10
nvmlEventTypeXidCriticalError = 8
nvmlClocksThrottleReasonHwSlowdown = 0x08
nvmlClocksThrottleReasonHwThermalSlowdown = 0x40


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801 - pynvml's names
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801
    pass


class NVMLError_Timeout(NVMLError):  # noqa: N801
    pass


@dataclass
class State:
    gpus: int = 1
    library: bool = True
    temp_c: float = 40.0
    used_mb: float = 1000.0
    total_mb: float = 80_000.0
    util_pct: float = 50.0
    throttle: int = 0
    ecc: int = 0
    remapped: tuple[int, int, int, int] = (0, 0, 0, 0)
    xids: list[int] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)
    inits: int = 0
    changes: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    t0: float = 0.0
    loaded: int = 0  # the scenario file's mtime when it was read


STATE = State()


def _load_scenario() -> None:
    path = os.environ.get("FAKE_NVML_SCENARIO")
    if not path:
        return
    try:
        mtime = os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return
    if mtime == STATE.loaded:
        return
    with open(path, encoding="utf-8") as file:
        scenario = json.load(file)
    STATE.loaded = mtime
    STATE.gpus = int(scenario.get("gpus", 1))
    STATE.t0 = float(scenario.get("t0", time.time()))
    STATE.changes = [(float(t), dict(change)) for t, change in scenario.get("changes", [])]


def _advance() -> None:
    """Apply the scenario's changes whose time has come (XIDs queue once)."""
    _load_scenario()
    now = time.time() - STATE.t0
    while STATE.changes and STATE.changes[0][0] <= now:
        _, change = STATE.changes.pop(0)
        for key, value in change.items():
            if key == "xids":
                STATE.xids.extend(value)
            else:
                setattr(STATE, key, tuple(value) if key == "remapped" else value)


_load_scenario()


def _check(name: str) -> None:
    _advance()
    if name in STATE.unsupported:
        raise NVMLError_NotSupported(f"{name}: Not Supported")


def nvmlInit() -> None:  # noqa: N802
    if not STATE.library:
        raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")
    STATE.inits += 1


def nvmlShutdown() -> None:  # noqa: N802
    STATE.inits -= 1


def nvmlDeviceGetCount() -> int:  # noqa: N802
    return STATE.gpus


def nvmlDeviceGetHandleByIndex(index: int) -> Any:  # noqa: N802
    if index >= STATE.gpus:
        raise NVMLError(f"invalid index {index}")
    return SimpleNamespace(index=index)


def nvmlDeviceGetName(handle: Any) -> str:  # noqa: N802
    return "Fake GPU"


def nvmlSystemGetDriverVersion() -> str:  # noqa: N802
    return "0.0-fake"


def nvmlDeviceGetTemperature(handle: Any, sensor: int) -> int:  # noqa: N802
    _check("temperature")
    return int(STATE.temp_c)


def nvmlDeviceGetMemoryInfo(handle: Any) -> Any:  # noqa: N802
    _check("memory")
    return SimpleNamespace(used=int(STATE.used_mb * 2**20), total=int(STATE.total_mb * 2**20))


def nvmlDeviceGetUtilizationRates(handle: Any) -> Any:  # noqa: N802
    _check("utilization")
    return SimpleNamespace(gpu=int(STATE.util_pct), memory=0)


def nvmlDeviceGetCurrentClocksEventReasons(handle: Any) -> int:  # noqa: N802
    _check("throttle")
    return STATE.throttle


def nvmlDeviceGetTotalEccErrors(handle: Any, error_type: int, counter_type: int) -> int:  # noqa: N802
    _check("ecc")
    return STATE.ecc


def nvmlDeviceGetRemappedRows(handle: Any) -> tuple[int, int, int, int]:  # noqa: N802
    _check("remapped_rows")
    return STATE.remapped


def nvmlEventSetCreate() -> Any:  # noqa: N802
    _check("xid")
    return SimpleNamespace(events=True)


def nvmlDeviceRegisterEvents(handle: Any, types: int, event_set: Any) -> None:  # noqa: N802
    _check("xid")


def nvmlEventSetWait_v2(event_set: Any, timeout_ms: int) -> Any:  # noqa: N802
    _advance()
    if not STATE.xids:
        raise NVMLError_Timeout("Timeout")
    return SimpleNamespace(eventData=STATE.xids.pop(0), eventType=nvmlEventTypeXidCriticalError)


def nvmlEventSetFree(event_set: Any) -> None:  # noqa: N802
    pass
