"""Checkpoint pieces without ranks: state trees, files and manifests, the store's choices,
the allocation clock, metrics continuation, and saving an offloaded (switched-out) module."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rlinf_hpc.cluster.allocation import Allocation, read_allocation
from rlinf_hpc.errors import UserError
from rlinf_hpc.runtime.checkpoint import capture_rng, host_copy, read_state, restore_rng, write_state
from rlinf_hpc.runtime.checkpoint.state import flatten
from rlinf_hpc.runtime.checkpoint.store import CheckpointStore, config_differences, open_checkpoint
from rlinf_hpc.runtime.metrics import MetricsLog
from rlinf_hpc.scheduler.offload import ModuleSwitch, OffloadOptions


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.95))
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
    return model, optimizer


def test_optimizer_and_model_state_round_trip_bitwise(tmp_path: Path) -> None:
    model, optimizer = _trained()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "note": "x", "n": 3}
    records = write_state(tmp_path, "actor-g0", host_copy(state))
    assert {r["name"] for r in records} == {"actor-g0.safetensors", "actor-g0.json"}
    back = read_state(tmp_path, "actor-g0")
    assert back["optimizer"]["param_groups"] == optimizer.state_dict()["param_groups"]  # tuples, ints
    assert set(back["optimizer"]["state"]) == {0, 1, 2, 3, 4, 5}  # integer keys stay integers
    fresh_model, fresh_optimizer = _trained()
    fresh_optimizer.state.clear()
    fresh_model.load_state_dict(back["model"])
    fresh_optimizer.load_state_dict(back["optimizer"])
    for a, b in zip(optimizer.state.values(), fresh_optimizer.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert b"pickle" not in (tmp_path / "actor-g0.json").read_bytes()


def test_state_trees_refuse_objects_with_their_path() -> None:
    with pytest.raises(TypeError, match=r"state\['opt'\]\[0\] is a builtins.object"):
        flatten({"opt": [object()]})
    with pytest.raises(TypeError, match="is not a JSON scalar"):
        flatten({("a", 1): 1})


def test_rng_states_round_trip(tmp_path: Path) -> None:
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    write_state(tmp_path, "rng", host_copy(capture_rng()))
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng(read_state(tmp_path, "rng"))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def _commit(store: CheckpointStore, step: int, config: dict | None = None) -> Path:
    staging = store.staging(step)
    records = write_state(staging, "w", {"x": torch.full((3,), float(step))})
    files = {r["name"]: {"size": r["size"], "sha256": r["sha256"]} for r in records}
    return store.commit(staging, {"step": step, "files": files, "config": config or {}})


def test_store_keeps_the_newest_and_skips_corrupt_and_partial(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for step in (2, 4, 6):
        _commit(store, step)
    for thread in store._deleting:
        thread.join()
    assert [p.name for p in store.committed()] == ["step-00000004", "step-00000006"]
    (tmp_path / "step-00000008.tmp").mkdir()  # crashed save: never chosen
    assert store.newest_complete().step == 6
    blob = tmp_path / "step-00000006" / "w.safetensors"
    blob.write_bytes(blob.read_bytes()[:-1] + b"\x00")
    assert store.newest_complete().step == 4
    (tmp_path / "step-00000004" / "manifest.json").unlink()
    assert store.newest_complete() is None
    with pytest.raises(ValueError, match="no manifest.json"):
        open_checkpoint(tmp_path / "step-00000004")


def test_lock_refuses_a_live_owner_and_takes_over_a_requeued_or_dead_one(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    lock = tmp_path / "LOCK"
    lock.write_text(
        json.dumps({"job_id": "7", "host": os.uname().nodename, "pid": os.getppid(), "since": time.time()})
    )
    with pytest.raises(UserError, match=f"pid {os.getppid()}"):
        store.acquire(job_id=None)
    store.acquire(job_id="7")  # the same SLURM job, requeued: its earlier run is gone
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    store.release()
    assert not lock.exists()


def test_config_differences_name_changed_and_fixed_keys() -> None:
    math = {"flow": {"runner": "math_grpo"}}  # its app adds grpo.steps (resumable), model. (fixed)
    saved = {
        **math,
        "grpo": {"lr": 1e-4, "steps": 10},
        "model": {"hidden_size": 32},
        "checkpoint": {"keep": 2},
    }
    current = {
        **math,
        "grpo": {"lr": 1e-3, "steps": 20},
        "model": {"hidden_size": 64},
        "checkpoint": {"keep": 5},
    }
    changed, fixed = config_differences(saved, current)
    assert changed == ["grpo.lr", "model.hidden_size"] and fixed == ["model.hidden_size"]
    changed, fixed = config_differences({**saved, "flow": {"runner": "hello"}}, current)
    assert "flow.runner" in fixed  # another app's state never loads


def test_keys_added_by_an_upgrade_are_no_config_change() -> None:
    from rlinf_hpc.config.loader import load_config
    from rlinf_hpc.runtime.checkpoint.resume import with_current_defaults

    config = load_config(Path(__file__).parents[1] / "configs" / "math_grpo_tiny.toml")
    current = config.model_dump(mode="json")
    saved = json.loads(json.dumps(current))
    del saved["grpo"]["vllm_kv_cache_gib"]  # written by a version without the key
    assert config_differences(saved, current)[0] == ["grpo.vllm_kv_cache_gib"]
    assert config_differences(with_current_defaults(saved), current) == ([], [])
    current["grpo"]["vllm_kv_cache_gib"] = 4.0  # set away from its default: a change
    assert config_differences(with_current_defaults(saved), current)[0] == ["grpo.vllm_kv_cache_gib"]
    assert with_current_defaults({"no": "such section"}) == {"no": "such section"}


def test_allocation_clock_from_slurm_variables() -> None:
    now = time.time()
    env = {
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_START_TIME": str(now - 3000),
        "SLURM_JOB_END_TIME": str(now + 600),
    }
    allocation = read_allocation(env)
    assert allocation is not None and allocation.job_id == "42"
    assert 590 < allocation.seconds_left(now + 1) < 600 and allocation.limit_s == 3600
    assert allocation.timed_out(now)  # ran 3000 s of 3600: >= limit - 10 min
    assert not Allocation("1", now - 100, now + 3500).timed_out(now)  # preempted early
    assert read_allocation({}) is None


def test_metrics_continue_after_a_resume_without_gaps_or_duplicates(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path)
    for step in range(1, 6):
        log.write(step, {"step": step})
    log.close()
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 6, "cut')  # the killed run's last line, cut short
    log = MetricsLog(tmp_path, resume_after=3)
    log.write(4, {"step": 4})
    log.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


@pytest.mark.parametrize("mode", ["none", "byte_planes"])
def test_offloaded_module_is_read_from_its_host_copy(mode: str) -> None:
    model, optimizer = _trained()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    switch = ModuleSwitch(model, optimizer, OffloadOptions(mode=mode))
    switch.offload()
    assert next(model.parameters()).numel() == 0
    with switch.host_view():
        seen = host_copy(model.state_dict())
        moments = host_copy(optimizer.state_dict())
    assert next(model.parameters()).numel() == 0  # released again: nothing came back to stay
    assert all(torch.equal(seen[k], expected[k]) for k in expected)
    assert moments["state"][0]["exp_avg"].numel() > 0
    switch.onload()
    assert all(torch.equal(model.state_dict()[k], expected[k]) for k in expected)


def _stop_manager(tmp_path: Path, allocation: Allocation | None, **settings: object):
    from rlinf_hpc.config import load_config
    from rlinf_hpc.runtime.checkpoint.manager import CheckpointManager

    from conftest import CONFIGS

    sets = [f"checkpoint.{k}={v}" for k, v in settings.items()]
    config = load_config(CONFIGS / "math_grpo_tiny.toml", [f"checkpoint.dir={tmp_path}", *sets])
    return CheckpointManager(config, None, allocation=allocation)


def test_requeue_decisions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlinf_hpc.errors import EXIT_NO_PROGRESS, EXIT_REQUEUED, EXIT_SAVED_AND_STOPPED, CheckpointStop
    from rlinf_hpc.runtime.checkpoint import requeue as module

    asked: list[str] = []
    monkeypatch.setattr(module, "requeue_after_exit", asked.append)
    monkeypatch.setattr(module, "can_requeue", lambda: True)
    now = time.time()
    timeout = Allocation("9", now - 3500, now + 100)  # ran 3500 s of a 3600 s limit
    preempted = Allocation("9", now - 60, now + 3540)

    def stop(reason: str = "signal SIGUSR2", progressed: bool = True) -> CheckpointStop:
        return CheckpointStop(reason, 5, "x", progressed)

    manager = _stop_manager(tmp_path, timeout, max_requeues=2)
    assert manager.exit_code_after_stop(stop(progressed=False)) == EXIT_NO_PROGRESS and not asked
    assert manager.exit_code_after_stop(stop()) == EXIT_REQUEUED
    assert manager.exit_code_after_stop(stop("allocation deadline (…)")) == EXIT_REQUEUED
    assert manager.exit_code_after_stop(stop()) == EXIT_NO_PROGRESS  # third timeout > max 2
    assert asked == ["9", "9"]
    preempt = _stop_manager(tmp_path, preempted, max_requeues=2)
    assert preempt.exit_code_after_stop(stop()) == EXIT_REQUEUED  # preemptions do not count
    assert json.loads((tmp_path / "requeues.json").read_text()) == {"timeouts": 2, "preemptions": 1}
    assert _stop_manager(tmp_path, None).exit_code_after_stop(stop()) == EXIT_SAVED_AND_STOPPED
    assert _stop_manager(tmp_path, preempted, requeue="false").exit_code_after_stop(stop()) == 3
    # a SIGTERM save (checkpoint.sigterm_save_s) is scancel's, or a preemption SLURM requeues itself
    assert preempt.exit_code_after_stop(stop("signal SIGTERM")) == EXIT_SAVED_AND_STOPPED
    assert asked == ["9", "9", "9"]
    monkeypatch.setattr(module, "can_requeue", lambda: False)
    assert _stop_manager(tmp_path, preempted).exit_code_after_stop(stop()) == EXIT_SAVED_AND_STOPPED


def test_a_sigterm_grace_not_under_the_clusters_kill_wait_is_warned_of(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from rlinf_hpc.runtime.checkpoint import manager as module

    monkeypatch.setattr(module, "kill_wait_s", lambda: 30.0)
    now = time.time()
    for grace, warned in ((20, False), (30, True), (0, False)):
        caplog.clear()
        manager = _stop_manager(tmp_path, Allocation("9", now - 60, now + 3540), sigterm_save_s=grace)
        manager.open()
        manager.close()
        said = [r.getMessage() for r in caplog.records if "KillWait" in r.getMessage()]
        assert bool(said) == warned, (grace, said)
        assert all("KillWait (30 s)" in text and "lower it below 30 s" in text for text in said), said


def test_torch_is_seeded_on_import_when_a_rank_seeds_before_it() -> None:
    """Ranks without torch code never import it (each saves ~3 s of CPU at start on a slow box);
    one that imports it after `seed_process` draws exactly what it would have drawn had torch
    been imported first, and its RNG capture then includes torch's."""
    program = """
import sys
import rlinf_hpc.runners.job, rlinf_hpc.workers
from rlinf_hpc.runtime.checkpoint.state import capture_rng, seed_process
assert "torch" not in sys.modules, "the runner or the worker base imports torch"
first = sys.argv[1] == "torch-first"
if first:
    import torch
seed_process(7, 3)
assert first or ("torch" not in capture_rng())
import torch
print(torch.rand(3).tolist(), "torch" in capture_rng())
"""
    run = [sys.executable, "-c", program]
    outputs = [
        subprocess.run([*run, order], capture_output=True, text=True, check=True).stdout
        for order in ("torch-first", "torch-later")
    ]
    assert outputs[0] == outputs[1] and outputs[0].strip().endswith("True"), outputs


def test_heartbeat_figures_survive_torch_being_imported_on_another_thread() -> None:
    """A rank may import torch late (its worker module), while its heartbeat thread reports
    memory: a half-imported torch (no ``torch.cuda`` yet) killed that thread, and the watchdog
    took the rank for frozen two minutes later."""
    program = """
import threading, time
from rlinf_hpc.runtime.heartbeat import memory_in_use
errors, done = [], threading.Event()
def beat():
    while not done.is_set():
        try:
            memory_in_use()
        except Exception as exc:
            errors.append(repr(exc))
        time.sleep(0.0005)
thread = threading.Thread(target=beat)
thread.start()
import torch
done.set()
thread.join()
print("errors", len(errors), errors[:1])
"""
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True).stdout
    assert out.startswith("errors 0 "), out


_DEFERRED_SIGTERM = """
import os, signal, sys, time
from rlinf_hpc.errors import JobInterrupted
from rlinf_hpc.runtime import signals
signals.install_signal_handlers()
case = sys.argv[1]
signals.defer_sigterm(0.3 if case in ("expiry", "left") else 30.0, coordinator=True,
                      dead=(lambda: True) if case == "dead" else None)
try:
    os.kill(os.getpid(), signal.SIGTERM)
    if case == "second":
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
    elif case == "left":  # the rank leaves before the grace ends: its timer must not fire
        signals.ignore_interrupts()
    for _ in range(100):
        time.sleep(0.01)
except JobInterrupted as exc:
    print("raised", exc.signal_name, "stop", signals.stop_requested())
else:
    print("went on", "stop", signals.stop_requested())
"""


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("flag", "went on stop SIGTERM"),  # the coordinator saves the next step boundary
        ("second", "raised SIGTERM stop SIGTERM"),  # a second SIGTERM stops at once
        ("expiry", "raised SIGTERM stop SIGTERM"),  # no step boundary within the grace
        ("dead", "raised SIGTERM stop None"),  # srun's SIGTERM after a task died: name it now
        ("left", "went on stop SIGTERM"),
    ],
)
def test_a_deferred_sigterm_flags_a_save_and_raises_on_a_second_signal_or_past_its_grace(
    case: str, said: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _DEFERRED_SIGTERM, case], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == said, (done.stdout, done.stderr)
