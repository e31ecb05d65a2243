"""CPU ranks sharing cores: the clock that measures it, the model that predicts it, and what
`auto` takes from a warm-up in which the ranks waited for cores."""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlinf_hpc.runtime.cpu_time import CpuClock
from rlinf_hpc.scheduler.contention import SharedCores, contended, slowdown
from rlinf_hpc.scheduler.cost_model import PhaseProfile
from rlinf_hpc.scheduler.pipeline import Stage, StepResult
from rlinf_hpc.scheduler.profiles import profiles_from_step
from rlinf_hpc.scheduler.rank_split import predict, predict_ahead
from rlinf_hpc.workers.base import Worker


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_the_clock_splits_a_busy_threads_time_into_work_and_its_wait_for_a_core() -> None:
    clock = CpuClock()
    if not clock.available:
        pytest.skip("no /proc/thread-self/schedstat on this kernel")
    cores = len(os.sched_getaffinity(0))
    lap, started = clock.lap(), time.monotonic()
    time.sleep(0.2)  # blocked: neither
    cpu, runqueue = clock.since(lap)
    assert cpu < 0.05 and runqueue < 0.05
    # as many spinning processes as cores, and this one: it waits for a core about half its time
    context = multiprocessing.get_context("fork")
    others = [context.Process(target=_spin, args=(1.5,)) for _ in range(cores)]
    for p in others:
        p.start()
    try:
        time.sleep(0.1)
        lap, started = clock.lap(), time.monotonic()
        _spin(0.8)
        wall = time.monotonic() - started
        cpu, runqueue = clock.since(lap)
    finally:
        for p in others:
            p.join()
    assert cpu + runqueue == pytest.approx(wall, rel=0.1)  # on a core or waiting for one
    assert runqueue > 0.15 * wall  # it waited (half of the time, ideally)


def test_slowdown_is_processor_sharing_over_the_neighbours_that_are_runnable() -> None:
    assert slowdown([], 2) == 1.0
    assert slowdown([1.0], 1) == 2.0
    assert slowdown([1.0] * 7, 2) == 4.0
    # three neighbours each runnable half the time on 2 cores: 0-1 of them (p 1/2): 1x,
    # 2 (3/8): 1.5x, 3 (1/8): 2x
    assert slowdown([0.5] * 3, 2) == pytest.approx(0.5 + 0.375 * 1.5 + 0.125 * 2.0)
    assert slowdown([1.0] * 3, 8) == 1.0  # more cores than ranks


def test_a_pipeline_whose_stages_take_turns_contends_less_than_a_collocated_step() -> None:
    """Two CPU stages on one rank each, a 2-core node shared by 4 worker ranks: apart, both
    ranks are alone with a core each; collocated, 4 ranks want 2 cores and take twice as long."""
    cores = SharedCores(nodes=(0, 0, 0, 0), cores=(2,))
    gen = PhaseProfile("gen", 0.02, cpu_fraction=1.0)
    train = PhaseProfile("train", 0.01, cpu_fraction=1.0)
    prediction = predict([gen, train], 64, 8, 4, cores=cores)
    alone = predict([gen, train], 64, 8, 4)
    assert prediction.collocated == pytest.approx(2 * alone.collocated, rel=0.01)
    # apart: 3 + 1 ranks, all four busy most of the step on 2 cores
    assert prediction.ranks_per_phase == alone.ranks_per_phase == {"gen": 3, "train": 1}
    assert alone.disaggregated < prediction.disaggregated < 2 * alone.disaggregated
    # with a core per rank nothing contends
    roomy = predict([gen, train], 64, 8, 4, cores=SharedCores((0, 0, 0, 0), (4,)))
    assert roomy.collocated == pytest.approx(alone.collocated)
    assert roomy.disaggregated == pytest.approx(alone.disaggregated)
    # a device's work (no CPU share) does not contend at all
    sleepy = [PhaseProfile("gen", 0.02), PhaseProfile("train", 0.01)]
    assert predict(sleepy, 64, 8, 4, cores=cores) == predict(sleepy, 64, 8, 4)


def test_ranks_on_other_nodes_do_not_contend() -> None:
    work = PhaseProfile("w", 0.01, cpu_fraction=1.0)
    one_node = SharedCores((0, 0), (1,))
    two_nodes = SharedCores((0, 1), (1, 1))
    together = contended([work], [{0, 1}], 100, one_node, lambda ps: 50 * ps[0].seconds_per_item)
    apart = contended([work], [{0, 1}], 100, two_nodes, lambda ps: 50 * ps[0].seconds_per_item)
    assert together == pytest.approx(1.0, rel=0.01) and apart == pytest.approx(0.5)
    # the coordinator keeps a quarter of a core busy beside one rank on a 1-core node
    busy = SharedCores((0,), (1,), background=(0.25,))
    assert contended([work], [{0}], 100, busy, lambda ps: 100 * ps[0].seconds_per_item) == pytest.approx(
        1.25, rel=0.01
    )


def test_off_policy_pipelines_side_by_side_contend_for_the_same_cores() -> None:
    gen = [PhaseProfile("gen", 0.01, cpu_fraction=1.0)]
    train = [PhaseProfile("train", 0.01, cpu_fraction=1.0)]
    alone = predict_ahead(gen, train, (100, 100), 10, 2)
    shared = predict_ahead(gen, train, (100, 100), 10, 2, cores=SharedCores((0, 0), (1,)))
    assert alone.disaggregated == pytest.approx(1.0)
    assert shared.disaggregated == pytest.approx(2.0, rel=0.02)  # two busy ranks, one core
    assert shared.collocated == pytest.approx(2 * alone.collocated, rel=0.02)


def _reply(rank: int, busy: float, runqueue: float, cpu: float, items: int, **more: float) -> dict:
    reply = {
        "rank": rank, "items": items, "busy_s": busy, "runqueue_s": runqueue, "cpu_s": cpu,
        "switch_s": 0.0, "finish_s": 0.0, "micro_batches": [items], "last_s": busy, "last_items": items,
    }  # fmt: skip
    reply.update(more)
    return reply


def test_auto_takes_the_wait_for_cores_out_of_what_the_warm_up_measured() -> None:
    stages = [Stage("gen", "generate"), Stage("train", "collect", "update", finish_scales=True)]
    pipe = SimpleNamespace(stages=stages)
    # two ranks, each waited for a core as long as it computed; the update too
    gen = [_reply(r, 2.0, 1.0, 1.0, 50) for r in (1, 2)]
    train = [
        _reply(r, 0.4, 0.2, 0.2, 50, finish_s=1.0, finish_runqueue_s=0.5, finish_cpu_s=0.5) for r in (1, 2)
    ]
    a, b = profiles_from_step(pipe, StepResult(1, [], {}, 3.4, "collocated", [], [gen, train]))
    assert a.seconds_per_item == pytest.approx(2 * 1.0 / 100) and a.cpu_fraction == pytest.approx(1.0)
    assert a.drain_seconds == pytest.approx(1.0)  # the last micro-batch's time alone, too
    assert b.finish_per_item == pytest.approx(0.5 * 2 / 100) and b.finish_cpu_fraction == pytest.approx(1.0)
    # a device's sleep: busy, not on a core; nothing to take out, no CPU share
    sleeping = [_reply(r, 2.0, 0.01, 0.02, 50) for r in (1, 2)]
    (c,) = profiles_from_step(_one_stage(), StepResult(1, [], {}, 2.0, "collocated", [], [sleeping]))
    assert c.seconds_per_item == pytest.approx(2 * 1.99 / 100) and c.cpu_fraction < 0.02
    # ranks that measured nothing (no schedstats): as before
    measured = ("cpu_s", "runqueue_s")
    bare = [{k: v for k, v in _reply(r, 2.0, 0.0, 0.0, 50).items() if k not in measured} for r in (1, 2)]
    (d,) = profiles_from_step(_one_stage(), StepResult(1, [], {}, 2.0, "collocated", [], [bare]))
    assert d.seconds_per_item == pytest.approx(0.04) and d.cpu_fraction == 0.0
    assert math.isclose(d.drain_seconds, 2.0)


def _one_stage() -> Any:
    return SimpleNamespace(stages=[Stage("gen", "generate")])


class _Trainer(Worker):
    def __init__(self, numbers: int) -> None:
        self.weights = torch.arange(numbers, dtype=torch.float32)

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "step": 3}


def test_a_worker_keeps_its_state_for_joining_ranks_unless_it_is_too_large_to_hand_on() -> None:
    trainer = _Trainer(256)
    assert trainer.keep_state() == {"state": True, "bytes": 1024, "kept": True}
    trainer.weights += 1  # a host copy: what the rank holds now does not change it
    assert trainer._kept_state["weights"][0] == 0.0 and trainer._kept_state["step"] == 3
    assert trainer.keep_state(limit_bytes=1000) == {"state": True, "bytes": 1024, "kept": False}
    assert trainer._kept_state is None  # auto keeps the split: nothing held for nobody
    assert Worker().keep_state() == {"state": False, "bytes": 0, "kept": False}


class _Group:
    def __init__(self, coordinator: _Coordinator, name: str, subset: tuple[int, ...] | None = None) -> None:
        self.coordinator, self.name, self.members = coordinator, name, subset

    def subset(self, ranks: list[int]) -> _Group:
        return _Group(self.coordinator, self.name, tuple(ranks))

    def call(self, method: str, *args: Any) -> Any:
        self.coordinator.calls.append((self.name, self.members, method, args))
        answer = self.coordinator.states.get(self.name) if method == "keep_state" and not args else None
        return SimpleNamespace(result=lambda: [answer])


class _Coordinator:
    """What `AutoPlacement._verify` uses of the coordinator, recorded."""

    def __init__(self, states: dict[str, dict[str, Any]]) -> None:
        placement = SimpleNamespace(auto_warmup_steps=1, auto_verify_steps=2)
        self.config = SimpleNamespace(placement=placement)
        self.placement = SimpleNamespace(groups={"rollout": [1], "reward": [2], "actor": [3]})
        self.states, self.calls, self.events = states, [], []

    def group(self, name: str) -> _Group:
        return _Group(self, name)

    def repartition(self, groups: dict[str, list[int]]) -> None:
        self.calls.append(("repartition", groups))
        self.placement.groups = dict(groups)

    def record(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))


def _verified(
    split_s: list[float], states: dict[str, dict[str, Any]], work: tuple[float, list[float]] | None = None
) -> tuple[_Coordinator, Any]:
    from rlinf_hpc.scheduler.autoplace import AutoPlacement

    coordinator = _Coordinator(states)
    auto = AutoPlacement(coordinator, "p")  # type: ignore[arg-type]
    auto.choice, auto.decided_at, auto.warmup_s, auto.split_steps = "disaggregated", 1, 1.0, split_s
    if work is not None:
        auto.warmup_work, auto.split_work = work
    auto.before = {name: [1, 2, 3] for name in ("rollout", "reward", "actor")}
    pipe = SimpleNamespace(close=lambda: coordinator.calls.append(("close",)), first_sizes={"actor": 2})
    auto._verify([pipe])  # type: ignore[list-item]
    return coordinator, auto


def test_auto_keeps_a_split_that_measured_faster_and_moves_back_from_one_that_did_not() -> None:
    small = {"actor": {"state": True, "bytes": 10, "kept": True}, "rollout": {"state": False}}
    small["reward"] = {"state": False, "bytes": 0, "kept": False}
    coordinator, auto = _verified([0.8, 0.9], small)
    assert coordinator.calls == [] and auto.choice == "disaggregated" and auto.verified
    assert coordinator.events[-1][1]["kept"] is True

    coordinator, auto = _verified([1.0, 1.2], small)
    assert auto.choice == "collocated" and auto.reverted and auto.verified
    methods = [call for call in coordinator.calls if call[0] != "close"]
    # the first rank of each component that ranks join keeps its state; only the actor has one
    assert ("actor", (0,), "keep_state", ()) in methods and ("rollout", (0,), "keep_state", ()) in methods
    assert ("repartition", auto.before) in methods
    assert methods[-1] == ("actor", None, "adopt_state", (3,))  # every actor rank takes rank 3's
    assert coordinator.placement.groups == auto.before

    large = {**small, "actor": {"state": True, "bytes": 3 << 30, "kept": False}}
    coordinator, auto = _verified([1.0, 1.2], large)
    assert auto.choice == "disaggregated" and not auto.reverted and auto.verified  # kept, warned
    assert not any(call[0] == "repartition" for call in coordinator.calls)
    assert coordinator.events[-1][1]["too_large"] == ["actor (3.0 GiB)"]
    assert ("actor", (0,), "keep_state", (-1,)) in coordinator.calls  # the copies dropped


def test_auto_compares_its_move_per_unit_of_work_when_the_flow_reports_it() -> None:
    """RL steps grow as responses lengthen: a split whose steps took longer because they did
    more work is kept, and one that only looked faster because its steps did less goes back."""
    small = {"actor": {"state": True, "bytes": 10, "kept": True}, "rollout": {"state": False}}
    small["reward"] = {"state": False, "bytes": 0, "kept": False}
    _, auto = _verified([1.05, 1.07], small, (1500.0, [1700.0, 1720.0]))  # 0.62 ms/token vs 0.67
    assert auto.choice == "disaggregated" and not auto.reverted
    _, auto = _verified([0.95, 0.97], small, (1500.0, [1300.0, 1310.0]))  # 0.74 ms/token
    assert auto.choice == "collocated" and auto.reverted
    _, auto = _verified([1.05, 1.07], small, (1500.0, [None, 1720.0]))  # not reported: seconds
    assert auto.choice == "collocated" and auto.reverted
