"""GPU health (NVML) with a fake NVML module: each finding raises its alarm, each action acts,
a hot GPU pauses its rank until it cools; and a job whose ranks see the fake GPU pauses, then
ends named on a hardware fault."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rlinf_hpc.config.watchdog import WatchdogConfig
from rlinf_hpc.runners.watching import act_on_gpu_alarm
from rlinf_hpc.runtime import signals
from rlinf_hpc.runtime.gpu_health import GpuGuard, open_guard
from rlinf_hpc.runtime.heartbeat import Heartbeat
from rlinf_hpc.runtime.watchdog import Watchdog

from conftest import job_env, probe_toml, rlinf

FAKE = Path(__file__).parent / "fake_nvml"


@pytest.fixture
def nvml() -> Any:
    spec = importlib.util.spec_from_file_location("fake_pynvml", FAKE / "pynvml.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fake_pynvml"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)  # a fresh STATE per test
    yield module
    del sys.modules["fake_pynvml"]


@pytest.fixture(autouse=True)
def _no_stop_left() -> Any:
    yield
    signals._stop_requested.clear()


def _kinds(alarms: list[Any]) -> list[str]:
    return [a.kind for a in alarms]


def test_overheat_pauses_until_the_gpu_is_five_degrees_cooler(nvml: Any) -> None:
    guard = GpuGuard(nvml, 0, temp_threshold_c=85.0)
    assert guard.poll(force=True) == [] and guard.cool.is_set()
    nvml.STATE.temp_c = 87
    assert _kinds(guard.poll(force=True)) == ["overheat"] and not guard.cool.is_set()
    nvml.STATE.temp_c = 82  # below the threshold, not 5 °C below: still paused
    assert guard.poll(force=True) == [] and not guard.cool.is_set()

    def cool_later() -> None:
        time.sleep(0.3)
        nvml.STATE.temp_c = 79
        guard.poll(force=True)

    threading.Thread(target=cool_later).start()
    paused: list[str] = []
    started = time.monotonic()
    assert guard.wait_until_cool(10.0, paused.append)
    assert 0.25 < time.monotonic() - started < 5.0
    assert paused == ["paused (GPU 0 too hot)"]
    assert _kinds(guard.alarms) == ["overheat", "cooled"]
    assert guard.figures["temp_c"] == 79 and guard.figures["paused"] is False


def test_a_pause_gives_up_after_its_maximum(nvml: Any) -> None:
    nvml.STATE.temp_c = 95
    guard = GpuGuard(nvml, 0)
    guard.poll(force=True)
    assert not guard.wait_until_cool(0.2)


def test_hardware_faults_raise_alarms_and_application_xids_do_not(nvml: Any) -> None:
    nvml.STATE.ecc = 3  # errors from before the job are not news
    guard = GpuGuard(nvml, 0)
    assert guard.poll(force=True) == []
    nvml.STATE.xids = [13, 79, 43]
    nvml.STATE.ecc = 4
    nvml.STATE.remapped = (0, 0, 1, 0)
    alarms = guard.poll(force=True)
    assert sorted(_kinds(alarms)) == ["ecc", "row_remap_pending", "xid"]
    by_kind = {a.kind: a for a in alarms}
    assert by_kind["xid"].value == 79 and by_kind["xid"].fault
    assert by_kind["ecc"].fault and "1 new uncorrected" in by_kind["ecc"].message
    assert not by_kind["row_remap_pending"].fault
    nvml.STATE.remapped = (0, 0, 1, 1)
    assert _kinds(guard.poll(force=True)) == ["row_remap_failure"]  # pending said once
    assert guard.poll(force=True) == []


def test_throttling_is_reported_once_per_reason(nvml: Any) -> None:
    guard = GpuGuard(nvml, 0)
    nvml.STATE.throttle = 0x40 | 0x04  # hardware thermal slowdown, and the (normal) power cap
    alarms = guard.poll(force=True)
    assert _kinds(alarms) == ["throttle"] and "hardware thermal" in alarms[0].message
    assert guard.poll(force=True) == []
    assert guard.figures["throttle"] == ["hardware thermal slowdown"]


def test_unsupported_queries_are_skipped_and_the_rest_still_works(nvml: Any) -> None:
    nvml.STATE.unsupported = {"ecc", "remapped_rows", "xid"}  # a consumer GPU
    guard = GpuGuard(nvml, 0)
    nvml.STATE.temp_c = 90
    assert _kinds(guard.poll(force=True)) == ["overheat"]
    assert guard.figures["mem_used_mb"] == pytest.approx(1000.0)


def test_polling_respects_its_interval(nvml: Any) -> None:
    guard = GpuGuard(nvml, 0, poll_s=60.0)
    guard.poll()
    nvml.STATE.temp_c = 99
    assert guard.poll() == []  # not yet
    assert _kinds(guard.poll(force=True)) == ["overheat"]


def test_open_guard_maps_cuda_visible_devices_and_is_off_without_nvml(nvml: Any) -> None:
    nvml.STATE.gpus = 4
    guard = open_guard("cuda:1", 85.0, 10.0, nvml=nvml, env={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert guard is not None and guard.index == 3
    assert open_guard("cpu", 85.0, 10.0, nvml=nvml) is None
    assert open_guard("cuda:2", 85.0, 10.0, nvml=nvml, env={"CUDA_VISIBLE_DEVICES": "0"}) is None
    nvml.STATE.library = False
    assert open_guard("cuda:0", 85.0, 10.0, nvml=nvml) is None


@pytest.mark.parametrize(
    ("kind", "settings", "expected"),
    [
        ("overheat", {}, "pause"),
        ("overheat", {"gpu_temp_action": "checkpoint_stop"}, "checkpoint_stop"),
        ("xid", {}, "checkpoint_stop"),
        ("ecc", {"gpu_fault_action": "abort"}, "abort"),
        ("row_remap_failure", {"gpu_fault_action": "warn"}, "warn"),
        ("still_hot", {}, "checkpoint_stop"),
        ("throttle", {"gpu_fault_action": "abort"}, "warn"),
        ("cooled", {}, "warn"),
    ],
)
def test_rank_zero_acts_on_alarms(kind: str, settings: dict[str, Any], expected: str) -> None:
    watch = WatchdogConfig(**settings)
    events: list[dict[str, Any]] = []
    fatal: list[dict[str, Any]] = []
    record = {"roles": "actor", "host": "node7", "activity": "actor.train"}
    alarm = {"id": 1, "kind": kind, "device": 0, "message": f"GPU 0: {kind}", "value": 1}
    action = act_on_gpu_alarm(
        watch, 3, record, alarm, lambda event, **kw: events.append({"event": event, **kw}),
        lambda message, culprit: fatal.append(culprit),
    )  # fmt: skip
    assert action == expected
    assert events == [{"event": "gpu_health", "rank": 3, "host": "node7", "component": "actor", "kind": kind,
                       "device": 0, "value": 1, "message": f"GPU 0: {kind}", "action": expected}]  # fmt: skip
    assert (signals.stop_requested() is not None) == (expected == "checkpoint_stop")
    assert fatal == ([{"rank": 3, "component": "actor", "host": "node7", "error": f"GPU {kind}",
                       "activity": "actor.train"}] if expected == "abort" else [])  # fmt: skip


def test_alarms_travel_in_heartbeats_to_rank_zeros_watch(tmp_path: Path, nvml: Any) -> None:
    seen: list[tuple[int, str]] = []
    heartbeat = Heartbeat(tmp_path, 1, interval=0.1, hang_timeout_s=30.0)
    heartbeat.watch_gpu(GpuGuard(nvml, 0, poll_s=0.1))
    watchdog = Watchdog(tmp_path, 2, 30.0, 0.1, "abort", lambda *a: None,
                        lambda rank, record, alarm: seen.append((rank, alarm["kind"])))  # fmt: skip
    try:
        nvml.STATE.temp_c = 91
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # later beats carry the same alarm: it is acted on once
    finally:
        watchdog.close()
        heartbeat.close()
    assert seen == [(1, "overheat")]
    record = json.loads((tmp_path / "heartbeats" / "rank-1.json").read_text())
    assert record["gpu"]["temp_c"] == 91 and record["gpu"]["paused"] is True


def test_service_starts_no_call_while_its_gpu_is_hot(nvml: Any) -> None:
    from rlinf_hpc.workers.service import WorkerService

    nvml.STATE.temp_c = 90
    guard = GpuGuard(nvml, 0)
    guard.poll(force=True)
    config = SimpleNamespace(watchdog=WatchdogConfig(gpu_pause_max_s=0.3))
    service = SimpleNamespace(heartbeat=SimpleNamespace(gpu=guard, doing=lambda *a: None), config=config)
    started = time.monotonic()
    WorkerService._pause_while_hot(service)  # type: ignore[arg-type]
    assert time.monotonic() - started >= 0.3
    assert guard.alarms[-1].kind == "still_hot"  # rank 0 then checkpoints and stops
    config.watchdog = WatchdogConfig(gpu_temp_action="warn")
    started = time.monotonic()
    WorkerService._pause_while_hot(service)  # type: ignore[arg-type]
    assert time.monotonic() - started < 0.1


@pytest.mark.mpi
def test_a_job_on_a_hot_gpu_pauses_then_ends_named_on_a_hardware_fault(tmp_path: Path) -> None:
    """Every rank sees one fake GPU. Once the ranks are up, the flow (`gpu_flow`) makes it 90 °C
    until 4 s, then an XID 79 at 6 s: the first call waits for the GPU to cool, and with
    ``gpu_fault_action = "abort"`` the XID ends the job, naming the rank and the fault."""
    scenario = tmp_path / "nvml.json"
    scenario.write_text(json.dumps({"gpus": 1}))
    extra = ("[watchdog]\nheartbeat_s = 0.5\nhang_timeout_s = 30.0\ngpu_poll_s = 0.5\n"
             'gpu_fault_action = "abort"\n')  # fmt: skip
    run_dir = tmp_path / "run"
    env = job_env({"FAKE_NVML_SCENARIO": str(scenario), "MPIEXEC_TIMEOUT": "80"})
    env["PYTHONPATH"] = os.pathsep.join([str(FAKE), env["PYTHONPATH"]])
    out = rlinf("run", str(probe_toml(tmp_path, "gpu_flow", extra=extra)), "--run-dir", str(run_dir),
                timeout=90, env=env)  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    gpu = [(e["rank"], e["kind"], e["action"]) for e in events if e["event"] == "gpu_health"]
    assert (1, "overheat", "pause") in gpu and (1, "cooled", "warn") in gpu, gpu
    assert any(kind == "xid" and action == "abort" for _, kind, action in gpu), gpu
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["culprit"]["error"] == "GPU xid", summary
    assert "critical XID 79" in text, text
    record = json.loads((run_dir / "gpu_flow.json").read_text())
    assert record["first_call_s"] >= 1.5, record  # it waited for the GPU to cool (at 4 s)
    assert record["nccl_debug_file"] == [str(run_dir / "nccl" / "nccl.%h.%p.log")]  # NCCL reports here
