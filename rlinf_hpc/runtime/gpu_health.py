"""GPU health through NVML: temperature, XID events, ECC, remapped rows, throttling, memory.

A rank that works on a GPU (its component joined with a ``cuda:k`` device) gets a `GpuGuard`;
its heartbeat thread calls `GpuGuard.poll` (every ``gpu_poll_s``; NVML answers in
milliseconds, and the XID wait never blocks) and carries the figures and the alarms in its
heartbeat record, where rank 0's watch reads them and acts (``runners/watching.py``):

- **temperature** ≥ ``gpu_temp_c`` (85 °C by default, the seed's threshold): ``warn``;
  ``pause`` — the rank starts no new call until the GPU is ``cool_margin_c`` below the
  threshold (it keeps beating, activity ``paused``; after ``pause_max_s`` it resumes and the job
  checkpoints and stops); or ``checkpoint_stop``.
- **hardware faults** — a critical XID that is not an application's own fault (13, 31, 43,
  45, 68, 109 are raised by faulty kernels, not by the hardware), a new uncorrected (double-bit)
  ECC error, a failed row remapping: ``warn``, ``checkpoint_stop`` (save while the GPU still
  answers) or ``abort``. A pending row remapping and a hardware slowdown, thermal or power-brake
  throttle are warnings (the first needs a GPU reset after the job).

Calls the device does not support (consumer GPUs have no ECC or row remapping) are skipped,
once, silently. ``nvml`` is the module to use (``pynvml`` from nvidia-ml-py by default; the
tests pass a fake one).

>>> physical_index("cuda:1", 4, {"CUDA_VISIBLE_DEVICES": "2,3"})
3
>>> physical_index("cpu", 4, {}) is None
True
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from rlinf_hpc.cluster.devices import _visible_indices
from rlinf_hpc.log import get_logger

log = get_logger("gpu")

#: XIDs that a faulty application raises (illegal address, page fault, ...), not the hardware.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
#: Throttle reasons worth a warning (NVML's bit -> what it means). Power capping under full load
#: and idle clocks are normal and not reported.
THROTTLE_REASONS = {
    0x08: "hardware slowdown (HW_SLOWDOWN: overheating or a power-supply fault)",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power-brake slowdown (an external power brake)",
}
FAULT_KINDS = frozenset({"xid", "ecc", "row_remap_failure"})
_MAX_ALARMS = 50  # kept in the heartbeat record (rank 0 reads the new ones by id)


def physical_index(device: str, num_physical: int, env: Mapping[str, str] | None = None) -> int | None:
    """NVML's index of torch's ``cuda:k`` (through CUDA_VISIBLE_DEVICES), None for a non-GPU."""
    if not device.startswith("cuda"):
        return None
    local = int(device.split(":", 1)[1]) if ":" in device else 0
    visible = _visible_indices(num_physical, os.environ if env is None else env)
    return visible[local] if local < len(visible) else None


@dataclass(frozen=True)
class GpuAlarm:
    """One finding: ``kind`` is overheat, cooled, still_hot, xid, ecc, row_remap_pending,
    row_remap_failure or throttle; ``fault`` for the hardware faults."""

    id: int
    kind: str
    device: int
    message: str
    value: float | None = None
    time: float = 0.0

    @property
    def fault(self) -> bool:
        return self.kind in FAULT_KINDS


class GpuGuard:
    """The health of the GPU at NVML index ``index``, polled from a rank's heartbeat thread."""

    def __init__(
        self,
        nvml: Any,
        index: int,
        temp_threshold_c: float = 85.0,
        cool_margin_c: float = 5.0,
        poll_s: float = 10.0,
    ) -> None:
        self.nvml = nvml
        self.index = index
        self.temp_threshold_c = temp_threshold_c
        self.cool_margin_c = cool_margin_c
        self.poll_s = poll_s
        nvml.nvmlInit()
        self.handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self.figures: dict[str, Any] = {"index": index}
        self.alarms: list[GpuAlarm] = []
        self.cool = threading.Event()  # set while the GPU is below the threshold
        self.cool.set()
        self._unsupported: set[str] = set()
        self._lock = threading.Lock()
        self._throttle_seen = 0
        self._next_id = 1
        self._last_poll = 0.0
        self._ecc_base = self._query("ecc", self._ecc_count)
        self._remap_reported: set[str] = set()
        self._events = self._query("xid", self._register_xid_events)

    # -- NVML queries, each skipped for good once the device says it does not support it ------

    def _query(self, name: str, call: Callable[[], Any]) -> Any:
        if name in self._unsupported:
            return None
        try:
            return call()
        except self.nvml.NVMLError as exc:
            if isinstance(exc, getattr(self.nvml, "NVMLError_NotSupported", ())):
                self._unsupported.add(name)
            else:
                log.debug("NVML %s on GPU %d: %s", name, self.index, exc)
            return None

    def _ecc_count(self) -> int:
        return int(
            self.nvml.nvmlDeviceGetTotalEccErrors(
                self.handle, self.nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, self.nvml.NVML_VOLATILE_ECC
            )
        )

    def _register_xid_events(self) -> Any:
        events = self.nvml.nvmlEventSetCreate()
        self.nvml.nvmlDeviceRegisterEvents(self.handle, self.nvml.nvmlEventTypeXidCriticalError, events)
        return events

    def _throttle(self) -> int:
        get = getattr(self.nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or (
            self.nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        return int(get(self.handle))

    # -- polling -------------------------------------------------------------------------------

    def note(self, kind: str, message: str, value: float | None = None) -> GpuAlarm:
        """An alarm of the rank's own (``still_hot``: a pause that did not cool the GPU)."""
        log.warning("%s", message)
        return self._alarm(kind, message, value)

    def _alarm(self, kind: str, message: str, value: float | None = None) -> GpuAlarm:
        with self._lock:  # the heartbeat thread polls, the main thread notes
            alarm = GpuAlarm(self._next_id, kind, self.index, message, value, time.time())
            self._next_id += 1
            self.alarms = [*self.alarms, alarm][-_MAX_ALARMS:]
        return alarm

    def poll(self, force: bool = False) -> list[GpuAlarm]:
        """Read the device (at most every ``poll_s`` unless ``force``); the new alarms."""
        now = time.monotonic()
        if not force and now - self._last_poll < self.poll_s:
            return []
        self._last_poll = now
        nvml, new = self.nvml, []
        sensor = nvml.NVML_TEMPERATURE_GPU
        temp = self._query("temperature", lambda: nvml.nvmlDeviceGetTemperature(self.handle, sensor))
        memory = self._query("memory", lambda: nvml.nvmlDeviceGetMemoryInfo(self.handle))
        util = self._query("utilization", lambda: nvml.nvmlDeviceGetUtilizationRates(self.handle))
        figures: dict[str, Any] = {"index": self.index}
        if temp is not None:
            figures["temp_c"] = float(temp)
        if memory is not None:
            figures["mem_used_mb"] = memory.used / 2**20
            figures["mem_total_mb"] = memory.total / 2**20
        if util is not None:
            figures["util_pct"] = float(util.gpu)
        if temp is not None:
            new += self._check_temperature(float(temp))
        throttle = self._query("throttle", self._throttle)
        if throttle is not None:
            figures["throttle"] = [name for bit, name in THROTTLE_REASONS.items() if throttle & bit]
            fresh = throttle & ~self._throttle_seen & sum(THROTTLE_REASONS)
            for bit, name in THROTTLE_REASONS.items():
                if fresh & bit:
                    new.append(self._alarm("throttle", f"GPU {self.index} clocks throttled: {name}"))
            self._throttle_seen |= throttle
        new += self._check_ecc() + self._check_remapped_rows() + self._check_xids()
        figures["paused"] = not self.cool.is_set()
        self.figures = figures
        return new

    def _check_temperature(self, temp: float) -> list[GpuAlarm]:
        if self.cool.is_set() and temp >= self.temp_threshold_c:
            self.cool.clear()
            message = f"GPU {self.index} at {temp:.0f} °C (threshold {self.temp_threshold_c:.0f} °C)"
            return [self._alarm("overheat", message, temp)]
        if not self.cool.is_set() and temp <= self.temp_threshold_c - self.cool_margin_c:
            self.cool.set()
            return [self._alarm("cooled", f"GPU {self.index} cooled to {temp:.0f} °C", temp)]
        return []

    def _check_ecc(self) -> list[GpuAlarm]:
        count = self._query("ecc", self._ecc_count)
        if count is None or self._ecc_base is None or count <= self._ecc_base:
            return []
        added, self._ecc_base = count - self._ecc_base, count
        message = f"GPU {self.index}: {added} new uncorrected (double-bit) ECC error(s), {count} since boot"
        return [self._alarm("ecc", message, count)]

    def _check_remapped_rows(self) -> list[GpuAlarm]:
        rows = self._query("remapped_rows", lambda: self.nvml.nvmlDeviceGetRemappedRows(self.handle))
        if rows is None:
            return []
        _corrected, _uncorrected, pending, failure = (int(v) for v in rows)
        out = []
        if failure and "failure" not in self._remap_reported:
            self._remap_reported.add("failure")
            message = f"GPU {self.index}: a row remapping failed (the memory is damaged: replace the GPU)"
            out.append(self._alarm("row_remap_failure", message))
        if pending and "pending" not in self._remap_reported:
            self._remap_reported.add("pending")
            message = (f"GPU {self.index}: a row remapping is pending (it takes effect after a GPU "
                       "reset: drain the node after this job)")  # fmt: skip
            out.append(self._alarm("row_remap_pending", message))
        return out

    def _check_xids(self) -> list[GpuAlarm]:
        if self._events is None:
            return []
        out = []
        wait = getattr(self.nvml, "nvmlEventSetWait_v2", None) or self.nvml.nvmlEventSetWait
        for _ in range(16):  # what is queued now; never blocks
            try:
                data = wait(self._events, 0)
            except self.nvml.NVMLError:  # NVML_ERROR_TIMEOUT: nothing queued
                break
            xid = int(data.eventData)
            if xid in APPLICATION_XIDS:
                log.info("GPU %d: XID %d (an application fault, not the hardware's)", self.index, xid)
                continue
            out.append(self._alarm("xid", f"GPU {self.index}: critical XID {xid}", xid))
        return out

    # -- what the rank's main thread and the heartbeat record see ------------------------------

    def wait_until_cool(self, max_s: float, on_pause: Callable[[str], None] | None = None) -> bool:
        """Block while the GPU is too hot (at most ``max_s``); True if it cooled (or was cool)."""
        if self.cool.is_set():
            return True
        temp = self.figures.get("temp_c")
        log.warning("GPU %d at %s °C: pausing work on this rank until it cools", self.index, temp)
        if on_pause is not None:
            on_pause(f"paused (GPU {self.index} too hot)")
        cooled = self.cool.wait(max_s)
        state = "cooled" if cooled else f"still hot after {max_s:.0f} s"
        log.warning("GPU %d %s: resuming work", self.index, state)
        return cooled

    def record(self) -> dict[str, Any]:
        return {"gpu": self.figures, "gpu_alarms": [asdict(a) for a in self.alarms]}

    def close(self) -> None:
        if self._events is not None:
            self._query("xid_free", lambda: self.nvml.nvmlEventSetFree(self._events))
        self._query("shutdown", self.nvml.nvmlShutdown)


def open_guard(
    device: str,
    temp_threshold_c: float,
    poll_s: float,
    nvml: Any = None,
    env: Mapping[str, str] | None = None,
) -> GpuGuard | None:
    """A guard for torch's ``device`` (None for a CPU device, or with one log line when NVML is
    not there: no driver, no nvidia-ml-py)."""
    if not device.startswith("cuda"):
        return None
    try:
        if nvml is None:
            import pynvml as nvml
        nvml.nvmlInit()
        index = physical_index(device, nvml.nvmlDeviceGetCount(), env)
        if index is None:
            log.info("GPU health: off (%s is not among the visible GPUs)", device)
            return None
        guard = GpuGuard(nvml, index, temp_threshold_c, poll_s=poll_s)
        nvml.nvmlShutdown()  # the guard holds its own reference (NVML counts init calls)
    except ImportError:
        log.info("GPU health: off (nvidia-ml-py is not installed)")
        return None
    except Exception as exc:  # noqa: BLE001 - NVMLError and friends: off, said once
        log.info("GPU health: off (NVML: %s)", exc)
        return None
    guard.poll(force=True)
    return guard
