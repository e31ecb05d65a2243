"""Pipeline pieces that need no ranks: stream sizing per placement, auto profiles, toy stage."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlinf_hpc.channel.policies import ConsumerView, ItemInfo, LocalFirst
from rlinf_hpc.config import config_from_dict
from rlinf_hpc.scheduler.autoplace import profiles_from_step
from rlinf_hpc.scheduler.pipeline import UNBOUNDED, Pipeline, StepResult
from rlinf_hpc.scheduler.placement import Placement
from rlinf_hpc.workers.memory import host_memory_fraction


def _pipeline(groups: dict[str, list[int]]) -> Pipeline:
    components = {name: {"worker": "pkg.mod:Cls"} for name in groups}
    config = config_from_dict({"components": components, "pipeline": {"capacity": 7}}, "test")
    coordinator = SimpleNamespace(config=config, placement=Placement(groups))
    pipe = Pipeline(coordinator, "p")  # type: ignore[arg-type]
    for name in groups:
        pipe.stage(name, "process")
    return pipe


def test_streams_are_bounded_only_between_ranks_that_run_at_the_same_time() -> None:
    apart = _pipeline({"a": [1], "b": [2], "c": [3]})._stream_specs(["s0", "s1", "s2"])
    assert [s["capacity"] for s in apart.values()] == [7, 7, 7]
    assert {s["policy"] for s in apart.values()} == {"performance_aware"}
    together = _pipeline({"a": [1, 2], "b": [1, 2]})._stream_specs(["s0", "s1"])
    assert together["s0"]["capacity"] == 7  # the coordinator feeds a running stage
    assert together["s1"]["policy"] == "local_first" and together["s1"]["capacity"] == UNBOUNDED
    # c shares a rank with a, which runs first there: c's input must not block b.
    hybrid = _pipeline({"a": [1], "b": [2], "c": [1]})._stream_specs(["s0", "s1", "s2"])
    assert hybrid["s1"]["capacity"] == 7 and hybrid["s2"]["capacity"] == UNBOUNDED


def test_stage_names_must_be_components_once() -> None:
    pipe = _pipeline({"a": [1]})
    with pytest.raises(KeyError, match="no component 'zz'"):
        pipe.stage("zz", "process")
    with pytest.raises(ValueError, match="'a' is a stage already"):
        pipe.stage("a", "other")


def test_local_first_keeps_items_on_the_producing_rank() -> None:
    policy = LocalFirst()
    views = [ConsumerView(0, 1, queued_items=0), ConsumerView(1, 2, queued_items=9)]
    policy.producer_rank = 2
    assert policy.select_consumer(ItemInfo(), views) == 1
    policy.producer_rank = 5  # not a consumer: shortest queue
    assert policy.select_consumer(ItemInfo(), views) == 0


def test_auto_profiles_are_per_rank_seconds_per_item() -> None:
    pipe = _pipeline({"a": [1, 2], "b": [1, 2]})
    per_rank = [
        [{"items": 10, "busy_s": 1.0, "switch_s": 0.2}, {"items": 30, "busy_s": 3.0, "switch_s": 0.4}],
        [
            {"items": 20, "busy_s": 0.1, "finish_s": 0.1, "switch_s": 0.0},
            {"items": 20, "busy_s": 0.2, "switch_s": 0.0},
        ],
    ]
    result = StepResult(1, [], {}, 1.0, "auto", [], per_rank)
    a, b = profiles_from_step(pipe, result)
    assert (a.name, a.seconds_per_item, a.switch_seconds) == ("a", pytest.approx(0.1), pytest.approx(0.3))
    assert (b.seconds_per_item, b.switch_seconds) == (pytest.approx(0.01), 0.0)


def test_host_memory_fraction_reads_meminfo(tmp_path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemFree:  1 kB\nMemAvailable:    250 kB\n")
    assert host_memory_fraction(meminfo) == pytest.approx(0.75)
    assert host_memory_fraction(tmp_path / "missing") == 0.0
    assert 0.0 < host_memory_fraction() < 1.0
