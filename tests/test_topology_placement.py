"""Rank -> node -> device map and component placement (pure functions, no MPI)."""

from __future__ import annotations

import pytest

from rlinf_hpc.cluster import GpuProbe, RankInfo, build_topology
from rlinf_hpc.config import Config
from rlinf_hpc.errors import UserError
from rlinf_hpc.scheduler import placement_rows, plan_placement


def infos(hosts: list[str], gpus: int = 0, local: bool = False) -> list[RankInfo]:
    return [
        RankInfo(
            rank,
            host,
            1000 + rank,
            None if not local else rank % 2,
            (0, 1),
            GpuProbe(gpus, ["H200"] * gpus, "ok" if gpus else "off"),
        )
        for rank, host in enumerate(hosts)
    ]


def config(placement: dict | None = None, **components: dict) -> Config:
    spec = {name: {"worker": "m:C", **c} for name, c in components.items()}
    return Config.model_validate({"components": spec, "placement": placement or {}})


def test_nodes_numbered_by_first_appearance_and_local_ranks_counted_per_host() -> None:
    slots = build_topology(infos(["n2", "n1", "n2", "n1"]))
    assert [(s.node_index, s.local_rank) for s in slots] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_gpu_devices_cycle_over_visible_gpus_using_launcher_local_rank() -> None:
    slots = build_topology(infos(["a"] * 4, gpus=2))
    assert [s.device for s in slots] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    slots = build_topology(infos(["a"] * 4, gpus=1, local=True))
    assert [s.device for s in slots] == ["cuda:0"] * 4


def test_sequential_placement_skips_coordinator() -> None:
    placement = plan_placement(config(a={"num_ranks": 2}, b={}), build_topology(infos(["h"] * 4)))
    assert placement.groups == {"a": [1, 2], "b": [3]}
    assert placement.components_on(2) == ["a"]


def test_explicit_ranks_may_be_shared_and_others_fill_around_them() -> None:
    cfg = config({"mode": "hybrid"}, a={"ranks": [2, 3]}, b={"ranks": [3]}, c={"num_ranks": 1})
    placement = plan_placement(cfg, build_topology(infos(["h"] * 4)))
    assert placement.groups == {"a": [2, 3], "b": [3], "c": [1]}
    assert placement.components_on(3) == ["a", "b"]


def test_too_few_ranks_says_how_many_and_how_to_ask() -> None:
    with pytest.raises(UserError) as err:
        plan_placement(config(a={"num_ranks": 2}, b={"num_ranks": 2}), build_topology(infos(["h"] * 4)))
    text = str(err.value)
    assert "component 'b' needs 2 worker rank(s) but only 1 remain" in text
    assert "--np 5" in text and "sbatch -n 5" in text and "srun -n 5" in text


def test_single_rank_job() -> None:
    with pytest.raises(UserError, match=r"single rank.*need 1 worker rank.*--np 2"):
        plan_placement(config(a={}), build_topology(infos(["h"])))


def test_explicit_rank_beyond_job() -> None:
    with pytest.raises(UserError, match=r"asks for ranks \[5\].*missing \[5\].*--np 6"):
        plan_placement(config(a={"ranks": [5]}), build_topology(infos(["h"] * 3)))


def test_gpu_component_without_gpus() -> None:
    with pytest.raises(UserError, match=r"needs 1 rank\(s\) with a GPU.*--gpus-per-task"):
        plan_placement(config(a={"device": "gpu"}), build_topology(infos(["h"] * 2)))
    with pytest.raises(UserError, match=r"ranks \[1\] see no GPU"):
        plan_placement(config(a={"device": "gpu", "ranks": [1]}), build_topology(infos(["h"] * 2)))


def test_gpu_component_placed_on_gpu_ranks_and_cpu_override_shown() -> None:
    slots = build_topology(infos(["h"] * 3, gpus=2))
    cfg = config(actor={"device": "gpu"}, reward={"device": "cpu"})
    placement = plan_placement(cfg, slots)
    rows = placement_rows(cfg, placement, slots)
    assert rows[0][0] == "(coordinator)" and rows[0][4] == "-"
    assert [(r[0], r[1], r[4]) for r in rows[1:]] == [("actor", "1", "cuda:1"), ("reward", "2", "cpu")]


def test_collocated_components_share_ranks() -> None:
    cfg = config({"mode": "collocated"}, rollout={"num_ranks": 3}, actor={"num_ranks": 2})
    placement = plan_placement(cfg, build_topology(infos(["h"] * 4)))
    assert placement.groups == {"rollout": [1, 2, 3], "actor": [1, 2]}
    assert placement.components_on(1) == ["rollout", "actor"]


def test_hybrid_groups_share_ranks_and_groups_stay_apart() -> None:
    hybrid = {"mode": "hybrid", "groups": [["rollout", "inference"]]}
    cfg = config(hybrid, rollout={"num_ranks": 2}, inference={"num_ranks": 2}, actor={"num_ranks": 1})
    placement = plan_placement(cfg, build_topology(infos(["h"] * 4)))
    assert placement.groups == {"rollout": [1, 2], "inference": [1, 2], "actor": [3]}
    with pytest.raises(UserError, match=r"'rollout\+inference \(sharing ranks\)' needs 2 worker rank"):
        plan_placement(cfg, build_topology(infos(["h"] * 2)))
