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


#: `PerformanceAware` keeps an item ready at consumers at most this many times slower than the fastest.
PREFETCH_SPEED = 2.0


class PerformanceAware(LoadBalancePolicy):
    """The consumer whose total work from this producer, in seconds at its measured rate,
    stays smallest with this item: (served + queued + weight) / rate.

    Balancing cumulative busy time (not just the queue) matters when the channel's capacity is
    small against the speed differences: a queue-based finish-time rule then never picks a
    consumer 10x slower than the rest (its one item always "finishes later"), which starves it
    for the whole run; this rule gives every consumer work in proportion to its speed.
    Consumers without a measured rate yet are assumed as fast as the fastest known one, so
    every consumer is tried early and measured.

    A consumer acknowledges an item when it takes it, so balancing cumulative time alone hands
    each consumer its next item just as it finishes the last: every item waits a round trip
    (acknowledgement, choice, transfer), which idles the fast consumers most. So a consumer at
    most ``PREFETCH_SPEED`` times slower than the fastest, with nothing queued, is served first:
    it keeps one item ready. Slower consumers are not: a round trip is a small part of their
    items, and an item queued behind one of them lengthens the stream's tail by a whole slow
    item (measured, tools/bench_channel.py, consumers 1/2/5/10x: capacity 4 makespan 1.29-1.41
    -> 1.20-1.23 of ideal, capacity 8 1.20-1.25 -> 1.16; prefetching for every consumer gave
    1.17-1.19 but busy-time imbalance 0.11-0.15 instead of <= 0.08).

    >>> fast = ConsumerView(0, 1, queued_items=1, queued_weight=1.0, served_weight=8.0, rate=1.0)
    >>> slow = ConsumerView(1, 2, queued_items=1, queued_weight=0.5, rate=0.1)
    >>> PerformanceAware().select_consumer(ItemInfo(weight=1.0), [fast, slow])  # slow: 15 s > 10 s
    0
    >>> fast.served_weight = 20.0
    >>> PerformanceAware().select_consumer(ItemInfo(weight=1.0), [fast, slow])  # fast: 22 s > 15 s
    1
    >>> fast.queued_items, fast.queued_weight = 0, 0.0
    >>> PerformanceAware().select_consumer(ItemInfo(weight=1.0), [fast, slow])  # fast has nothing ready
    0
    """

    def select_consumer(self, item: ItemInfo, consumers: list[ConsumerView]) -> int:
        known = [c.rate for c in consumers if c.rate]
        default = max(known) if known else 1.0

        def busy_s(c: ConsumerView) -> tuple[float, int]:
            return ((c.served_weight + c.queued_weight + item.weight) / (c.rate or default), c.index)

        ready = [
            c for c in consumers if not c.queued_items and (c.rate or default) * PREFETCH_SPEED >= default
        ]
        return min(ready or consumers, key=busy_s).index


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
