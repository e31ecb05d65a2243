"""Channel pieces that need no MPI: policies, config validation, rank resolution."""

from __future__ import annotations

from collections import Counter

import pytest

from rlinf_hpc.channel import (
    ConsumerView,
    ItemInfo,
    LoadBalancePolicy,
    PerformanceAware,
    ShortestQueue,
    WeightedRoundRobin,
    resolve_policy,
)
from rlinf_hpc.channel.policies import checked_choice
from rlinf_hpc.config import Config, config_from_dict
from rlinf_hpc.errors import UserError
from rlinf_hpc.scheduler.placement import channel_specs


def views(*specs: dict) -> list[ConsumerView]:
    return [ConsumerView(i, 10 + i, **spec) for i, spec in enumerate(specs)]


def test_weighted_round_robin_follows_shares() -> None:
    policy, consumers = WeightedRoundRobin(), views({"share": 1.0}, {"share": 3.0})
    picks = Counter(policy.select_consumer(ItemInfo(), consumers) for _ in range(400))
    assert picks == {0: 100, 1: 300}


def test_shortest_queue_uses_queued_weight() -> None:
    consumers = views({"queued_weight": 5.0, "queued_items": 1}, {"queued_weight": 2.0, "queued_items": 4})
    assert ShortestQueue().select_consumer(ItemInfo(), consumers) == 1


def test_performance_aware_picks_earliest_finish_and_tries_unmeasured() -> None:
    fast_busy = views({"queued_weight": 4.0, "rate": 4.0}, {"queued_weight": 0.0, "rate": 0.5})
    # (4 + 1) / 4 = 1.25 s beats (0 + 1) / 0.5 = 2 s
    assert PerformanceAware().select_consumer(ItemInfo(weight=1.0), fast_busy) == 0
    unmeasured = views({"queued_weight": 3.0, "rate": 1.0}, {"queued_weight": 0.0})
    assert PerformanceAware().select_consumer(ItemInfo(weight=1.0), unmeasured) == 1


def test_performance_aware_balances_reported_busy_time_not_served_weight() -> None:
    # Both served 100 units; at today's rate estimate consumer 0 would look 10 s ahead, but it
    # reported 100 s busy like consumer 1: what it holds decides (1 + 1 s vs 2 + 1 s).
    consumers = views(
        {"busy_s": 100.0, "served_weight": 100.0, "taken_weight": 1.0, "rate": 1.0},
        {"busy_s": 100.0, "served_weight": 100.0, "taken_weight": 2.0, "rate": 1.0},
    )
    consumers[0].rate = 1.1  # its estimate moved
    assert PerformanceAware().select_consumer(ItemInfo(weight=1.0), consumers) == 0
    consumers[0].busy_s = 102.0  # it really was busier
    assert PerformanceAware().select_consumer(ItemInfo(weight=1.0), consumers) == 1


def test_performance_aware_gives_an_unmeasured_consumer_one_item_at_a_time() -> None:
    # Unmeasured and holding an item: however cheap it looks at the assumed rate, it waits
    # for its first report (a slow consumer hoarding the capacity at the start was the bug).
    holding = views({"busy_s": 5.0, "rate": 1.0}, {"taken_weight": 1.0})
    assert PerformanceAware().select_consumer(ItemInfo(weight=1.0), holding) == 0
    # Everyone unmeasured and busy (the start of a wide channel): still an answer, balanced.
    start = views({"taken_weight": 2.0}, {"taken_weight": 1.0})
    assert PerformanceAware().select_consumer(ItemInfo(weight=1.0), start) == 1
    # Weightless items cost nothing anywhere: they are spread by queue length, not all sent
    # to the first consumer.
    weightless = views({"queued_items": 3}, {"queued_items": 1})
    assert PerformanceAware().select_consumer(ItemInfo(weight=0.0), weightless) == 1


def test_invalid_policy_answers_are_caught() -> None:
    class Bad(LoadBalancePolicy):
        def select_consumer(self, item: ItemInfo, consumers: list[ConsumerView]) -> int:
            return True  # a bool is not an index

    with pytest.raises(
        ValueError, match=r"Bad.select_consumer returned True; it must return an index in 0..1"
    ):
        checked_choice(Bad(), ItemInfo(), views({}, {}))


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("nope", "neither built in"),
        ("no_module_here:Policy", "cannot import module 'no_module_here'"),
        ("rlinf_hpc.channel.policies:ItemInfo", "not a subclass"),
    ],
)
def test_policy_names_that_do_not_resolve(name: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        resolve_policy(name)


BASE = {"components": {"rollout": {"worker": "m:C", "num_ranks": 2}, "actor": {"worker": "m:C"}}}


def test_channel_members_must_be_components() -> None:
    bad = {**BASE, "channels": {"x": {"producers": "rolout", "consumers": "actor"}}}
    with pytest.raises(UserError, match=r"channels.x.producers names \['rolout'\]"):
        config_from_dict(bad, "job.toml")
    bad = {**BASE, "channels": {"x": {"producers": "actor", "consumers": "coordinator"}}}
    with pytest.raises(UserError, match="the coordinator cannot consume"):
        config_from_dict(bad, "job.toml")
    bad = {**BASE, "channels": {"x": {"producers": "actor", "consumers": "rollout", "capacity": 0}}}
    with pytest.raises(UserError, match=r"`channels.x.capacity`"):
        config_from_dict(bad, "job.toml")


def test_channel_specs_resolve_ranks_and_check_weights() -> None:
    config = Config.model_validate(
        {
            **BASE,
            "channels": {
                "x": {
                    "producers": ["coordinator", "actor"],
                    "consumers": "rollout",
                    "consumer_weights": [1, 2],
                    "offload_above": 0.8,
                    "lineage": "rollout.0",
                }
            },
        }
    )
    spec = channel_specs(config.channels, {"rollout": [1, 2], "actor": [3]})["x"]
    assert (spec.producers, spec.consumers, spec.consumer_weights) == ((0, 3), (1, 2), (1.0, 2.0))
    # every setting reaches the ranks (offload_above was dropped here before)
    assert (spec.offload_above, spec.lineage) == (0.8, "rollout.0")
    with pytest.raises(UserError, match="consumer_weights has 2 entries but the channel has 3"):
        channel_specs(config.channels, {"rollout": [1, 2, 4], "actor": [3]})
