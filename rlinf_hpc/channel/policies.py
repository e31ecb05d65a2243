"""Load-balancing policies: which consumer gets the next item of a channel.

A policy sees the item's descriptor and one `ConsumerView` per consumer (queue, service so far,
measured rate) and returns the index of the consumer to send to. Built-in policies are named in
the config (``weighted_round_robin``, ``shortest_queue``, ``performance_aware``); a user policy
is a `LoadBalancePolicy` subclass named by import path (``my_module:MyPolicy``).

>>> views = [ConsumerView(0, 1, queued_items=3), ConsumerView(1, 2, queued_items=1)]
>>> ShortestQueue().select_consumer(ItemInfo(weight=1.0), views)
1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlinf_hpc.errors import UserError
from rlinf_hpc.imports import import_subclass


@dataclass(frozen=True)
class ItemInfo:
    """What a policy knows about the item being placed."""

    weight: float = 1.0
    key: Any = None
    nbytes: int = 0


@dataclass
class ConsumerView:
    """A producer's view of one consumer, kept current by the consumer's acknowledgements."""

    index: int
    rank: int
    #: Items sent to it and not yet acknowledged as consumed (or queued weight).
    queued_items: int = 0
    queued_weight: float = 0.0
    served_items: int = 0
    served_weight: float = 0.0
    #: Busy seconds the consumer spent on the items from this producer it has finished, and the
    #: weight of those it took last and is working on (both as of its last acknowledgement).
    busy_s: float = 0.0
    taken_weight: float = 0.0
    #: Weight the consumer processes per second of busy time (None until measured).
    rate: float | None = None
    #: Static share for weighted round-robin (``consumer_weights`` in the config).
    share: float = 1.0
    #: Seconds the consumer has spent waiting for items so far (its starvation).
    waited_s: float = 0.0


class LoadBalancePolicy:
    """Subclass and implement `select_consumer`; return an index into ``consumers``."""

    def select_consumer(self, item: ItemInfo, consumers: list[ConsumerView]) -> int:
        raise NotImplementedError


class WeightedRoundRobin(LoadBalancePolicy):
    """Each consumer receives weight in proportion to its ``share`` (smooth weighted RR)."""

    def __init__(self) -> None:
        self._credit: dict[int, float] = {}

    def select_consumer(self, item: ItemInfo, consumers: list[ConsumerView]) -> int:
        total = sum(c.share for c in consumers)
        for c in consumers:
            self._credit[c.rank] = self._credit.get(c.rank, 0.0) + c.share
        best = max(consumers, key=lambda c: (self._credit[c.rank], -c.index))
        self._credit[best.rank] -= total
        return best.index


class ShortestQueue(LoadBalancePolicy):
    """The consumer with the least queued weight (ties: fewest items, then lowest index)."""

    def select_consumer(self, item: ItemInfo, consumers: list[ConsumerView]) -> int:
        return min(consumers, key=lambda c: (c.queued_weight, c.queued_items, c.index)).index


class PerformanceAware(LoadBalancePolicy):
    """The consumer whose busy time on this producer's items stays smallest with this item:
    the busy seconds it reported for the items it finished, plus what it holds (taken and
    queued) and this item at its measured rate.

    Balancing cumulative busy time (not just the queue) matters when the channel's capacity is
    small against the speed differences: a queue-based finish-time rule then never picks a
    consumer 10x slower than the rest (its one item always "finishes later"), which starves it
    for the whole run; this rule gives every consumer work in proportion to its speed. The
    busy seconds come from the consumers themselves: served weight over the current rate
    estimate drifts as the estimate moves (fast consumers, whose per-item overhead shows in
    their rate, looked "ahead" and idled; 1.2-1.4x the ideal makespan at capacity 4).

    A consumer without a measured rate counts as fast as the fastest known one, so each is
    tried early, but it gets no second item before it reports a rate: a slow consumer
    otherwise hoards the channel's capacity with queued items at the start while the others
    run dry. Channels of one lineage start from the rates the last one measured.

    >>> fast = ConsumerView(0, 1, busy_s=8.0, queued_items=1, queued_weight=1.0, rate=1.0)
    >>> slow = ConsumerView(1, 2, busy_s=5.0, queued_items=1, queued_weight=0.5, rate=0.1)
    >>> PerformanceAware().select_consumer(ItemInfo(weight=1.0), [fast, slow])  # slow: 20 s > 10 s
    0
    >>> fast.busy_s = 20.0
    >>> PerformanceAware().select_consumer(ItemInfo(weight=1.0), [fast, slow])  # fast: 22 s > 20 s
    1
    """

    def select_consumer(self, item: ItemInfo, consumers: list[ConsumerView]) -> int:
        known = [c.rate for c in consumers if c.rate]
        default = max(known) if known else 1.0

        def key(c: ConsumerView) -> tuple[bool, float, int, int]:
            unmeasured_busy = not c.rate and (c.taken_weight > 0 or c.queued_items > 0)
            work = c.busy_s + (c.taken_weight + c.queued_weight + item.weight) / (c.rate or default)
            return unmeasured_busy, work, c.queued_items, c.index  # weightless items: spread

        return min(consumers, key=key).index


class LocalFirst(LoadBalancePolicy):
    """The consumer on the producer's own rank (no copy, no transfer); otherwise the shortest
    queue. Used between pipeline stages that share ranks. ``producer_rank`` is set by the
    channel."""

    producer_rank: int | None = None

    def select_consumer(self, item: ItemInfo, consumers: list[ConsumerView]) -> int:
        for c in consumers:
            if c.rank == self.producer_rank:
                return c.index
        return ShortestQueue().select_consumer(item, consumers)


BUILTIN_POLICIES: dict[str, type[LoadBalancePolicy]] = {
    "weighted_round_robin": WeightedRoundRobin,
    "round_robin": WeightedRoundRobin,
    "shortest_queue": ShortestQueue,
    "performance_aware": PerformanceAware,
    "local_first": LocalFirst,
}


def resolve_policy(name: str) -> LoadBalancePolicy:
    """A fresh policy for a built-in name or ``package.module:Class``; `UserError` if neither."""
    if name in BUILTIN_POLICIES:
        return BUILTIN_POLICIES[name]()
    if ":" not in name:
        raise UserError(
            f"channel policy '{name}' is neither built in ({', '.join(sorted(BUILTIN_POLICIES))}) "
            "nor an import path 'package.module:Class'."
        )
    cls = import_subclass(name, LoadBalancePolicy, "channel policy")
    return cls()


def checked_choice(policy: LoadBalancePolicy, item: ItemInfo, consumers: list[ConsumerView]) -> int:
    """Run the policy and insist on a valid index (a user policy's bug names the policy)."""
    choice = policy.select_consumer(item, consumers)
    if isinstance(choice, bool) or not isinstance(choice, int) or not 0 <= choice < len(consumers):
        raise ValueError(
            f"{type(policy).__name__}.select_consumer returned {choice!r}; it must return an index "
            f"in 0..{len(consumers) - 1} (one per consumer)"
        )
    return choice
