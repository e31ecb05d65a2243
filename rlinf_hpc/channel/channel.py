"""Channels: a distributed FIFO from producer ranks to consumer ranks, with per-item weights.

Payload goes from producer to consumer directly, in one hop, over the data plane; nothing is
relayed through a broker. Each producer runs the channel's load-balancing policy itself, over a
view of every consumer (queued items and weight, service so far, measured rate) that the
consumers keep current with small acknowledgements travelling back on a separate tag. So
metadata and payload take separate paths, and the descriptors of items in flight live where
they were produced.

* Backpressure: a producer has at most ``capacity`` unacknowledged items out; `put` then waits
  (or raises `ChannelFull` with ``block=False``). Memory on both sides stays bounded.
* Keys: items with the same key go to the same consumer, in order; ``get(key=k)`` takes the
  next item with that key.
* `close` (every producer) sends end-of-stream after the last item; consumers drain what is
  left and then get `EndOfStream`.
* A producer that is also a consumer of its own channel hands items over without a copy.

Usage, on a worker (the channel is declared under ``[channels.NAME]`` in the config)::

    out = self.channel("rollout_to_actor")
    out.put({"tokens": t, "logprobs": lp}, weight=len(t))
    ...
    batch = self.channel("rollout_to_actor").get_batch(target_weight=4096)
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from rlinf_hpc.channel.policies import ConsumerView, ItemInfo, checked_choice, resolve_policy
from rlinf_hpc.comm import Backoff, ChannelSpec, DataPlane, WorkHandle
from rlinf_hpc.errors import CommTimeoutError

# Item ids below zero are markers, in order with the items on the same (sender, tag) stream.
_END = -1  # the producer closed the channel
_FENCE = -2  # the producer sends nothing more to this (former) consumer
_FORWARDED = -3  # a former consumer has passed on everything it held
_ACK_FLUSH_S = 1e-3  # acknowledgements leave at least this often while items are consumed


class EndOfStream(Exception):
    """Every producer closed the channel and this consumer has taken every item."""


class ChannelFull(Exception):
    """``put(block=False)`` found ``capacity`` items of this producer unacknowledged."""


@dataclass
class _Received:
    item_id: int
    producer: int  # where the acknowledgement goes (the item's origin, also when forwarded)
    key: Any
    weight: float
    value: Any


class Channel:
    """One rank's handle on a channel (it may be producer, consumer, or both)."""

    def __init__(self, plane: DataPlane, name: str) -> None:
        channels = plane.directory.channels
        if name not in channels:
            known = ", ".join(sorted(channels)) or "none"
            raise ValueError(f"no channel '{name}' in the job (channels: {known})")
        self.plane = plane
        self.name = name
        self._item_tag = ("channel", name, "item")
        self._ack_tag = ("channel", name, "ack")
        self._spec: ChannelSpec = channels[name]
        # producer side
        self._policy = resolve_policy(self._spec.policy)
        self._views: dict[int, ConsumerView] = {}
        self._outstanding: dict[int, tuple[int, float]] = {}
        self._key_owner: dict[Any, int] = {}
        self._next_id = 0
        self._closed = False
        self._put_wait_s = 0.0
        # consumer side
        self._queue: deque[_Received] = deque()
        self._ended: set[int] = set()
        self._forwarders: set[int] = set()  # former consumers passing their items on
        self._ack_sources: set[int] = set(self._spec.consumers)
        self._acks: dict[int, list[float]] = {}
        self._last_ack_flush = time.monotonic()
        self._busy_since: float | None = None
        self._pending_weight = 0.0
        self._rate: float | None = None
        self._served_items = 0
        self._served_weight = 0.0
        self._get_wait_s = 0.0
        self._forwarded_items = 0
        self._refresh_views()

    # -- membership ------------------------------------------------------------------------
    @property
    def is_producer(self) -> bool:
        return self.plane.rank in self._spec.producers

    @property
    def is_consumer(self) -> bool:
        return self.plane.rank in self._spec.consumers

    def _refresh_views(self) -> None:
        spec = self.plane.directory.channels.get(self.name, self._spec)
        self._spec = spec
        shares = spec.consumer_weights or (1.0,) * len(spec.consumers)
        views = {}
        for index, (rank, share) in enumerate(zip(spec.consumers, shares, strict=True)):
            view = self._views.get(rank) or ConsumerView(index, rank)
            view.index, view.share = index, share
            views[rank] = view
        self._views = views

    # -- producer ----------------------------------------------------------------------------
    def put(
        self,
        item: Any,
        weight: float = 1.0,
        key: Any = None,
        block: bool = True,
        timeout: float | None = None,
    ) -> None:
        """Send ``item`` to a consumer chosen by the policy. Returns once the item's buffers
        may be reused. With ``block=False`` a full channel raises `ChannelFull` at once."""
        handle = self.put_async(item, weight, key, block, timeout)
        handle.wait(timeout)

    def put_async(
        self,
        item: Any,
        weight: float = 1.0,
        key: Any = None,
        block: bool = True,
        timeout: float | None = None,
    ) -> WorkHandle:
        """Start a put; the handle completes when the item's buffers may be reused."""
        self._check_put(weight)
        self._wait_for_room(block, timeout)
        consumer = self._choose(ItemInfo(weight, key))
        item_id = self._next_id
        self._next_id += 1
        view = self._views[consumer]
        view.queued_items += 1
        view.queued_weight += weight
        self._outstanding[item_id] = (consumer, weight)
        message = (item_id, key, float(weight), item, self.plane.rank)
        return self.plane.isend(message, consumer, self._item_tag)

    def put_batch(
        self,
        items: list[Any],
        weights: list[float] | None = None,
        keys: list[Any] | None = None,
        timeout: float | None = None,
    ) -> None:
        """`put` each item (with its weight and key), waiting once at the end."""
        weights = weights or [1.0] * len(items)
        keys = keys or [None] * len(items)
        if not len(items) == len(weights) == len(keys):
            raise ValueError("put_batch needs as many weights and keys as items")
        triples = zip(items, weights, keys, strict=True)
        handles = [self.put_async(item, weight, key, True, timeout) for item, weight, key in triples]
        for handle in handles:
            handle.wait(timeout)

    def _check_put(self, weight: float) -> None:
        if not self.is_producer:
            raise ValueError(
                f"{self.plane.directory.name_of(self.plane.rank)} is not a producer of channel "
                f"'{self.name}' (producers: ranks {list(self._spec.producers)})"
            )
        if self._closed:
            raise ValueError(f"put on channel '{self.name}' after this producer closed it")
        if not isinstance(weight, (int, float)) or weight < 0 or weight != weight:
            raise ValueError(f"channel '{self.name}': item weight must be a number >= 0, got {weight!r}")
        if not self._views:
            raise ValueError(f"channel '{self.name}' has no consumers right now")

    def _choose(self, item: ItemInfo) -> int:
        if item.key is not None and self._key_owner.get(item.key) in self._views:
            return self._key_owner[item.key]
        views = sorted(self._views.values(), key=lambda v: v.index)
        rank = views[checked_choice(self._policy, item, views)].rank
        if item.key is not None:
            self._key_owner[item.key] = rank
        return rank

    def _wait_for_room(self, block: bool, timeout: float | None) -> None:
        self._take_acks()
        if len(self._outstanding) < self._spec.capacity:
            return
        if not block:
            raise ChannelFull(
                f"channel '{self.name}': {len(self._outstanding)} items of this producer are not "
                f"consumed yet (capacity {self._spec.capacity})"
            )
        start = time.monotonic()
        self.plane.flush()
        backoff = Backoff(spin=1e-3)
        while len(self._outstanding) >= self._spec.capacity:
            if timeout is not None and time.monotonic() - start > timeout:
                raise CommTimeoutError(
                    f"{self.plane.directory.name_of(self.plane.rank)} waited {timeout:.1f} s for room "
                    f"in channel '{self.name}' (capacity {self._spec.capacity}); consumers "
                    f"{list(self._spec.consumers)} are not taking items"
                )
            backoff.sleep()
            if self._take_acks():
                backoff.reset()
        self._put_wait_s += time.monotonic() - start

    def _take_acks(self) -> bool:
        got = False
        for consumer in sorted(self._ack_sources):
            while True:
                found, ack = self.plane.try_recv(consumer, self._ack_tag)
                if not found:
                    break
                got = True
                self._apply_ack(consumer, ack)
        return got

    def _apply_ack(self, acker: int, ack: tuple) -> None:
        item_ids, rate = ack
        served_by = self._views.get(acker)
        for item_id in item_ids:
            assigned, weight = self._outstanding.pop(item_id, (None, 0.0))
            queued_at = self._views.get(assigned) if assigned is not None else None
            if queued_at is not None:
                queued_at.queued_items -= 1
                queued_at.queued_weight -= weight
            if served_by is not None:
                served_by.served_items += 1
                served_by.served_weight += weight
        if served_by is not None and rate:
            served_by.rate = rate

    def close(self) -> None:
        """This producer is done: every consumer gets end-of-stream after its last item."""
        if self._closed or not self.is_producer:
            return
        self._closed = True
        for consumer in self._spec.consumers:
            self.plane.isend((_END, None, 0.0, None, self.plane.rank), consumer, self._item_tag)
        self.plane.flush()

    # -- consumer ----------------------------------------------------------------------------
    def get(self, key: Any = None, timeout: float | None = None) -> Any:
        """The next item (with ``key``, if given); raises `EndOfStream` once all producers
        closed and nothing is left."""
        return self.get_batch(max_items=1, key=key, timeout=timeout)[0]

    def get_batch(
        self,
        max_items: int | None = None,
        target_weight: float | None = None,
        key: Any = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """At least one item, then as many as are here up to ``max_items`` items or until
        their weights reach ``target_weight``."""
        if not self.is_consumer:
            raise ValueError(
                f"{self.plane.directory.name_of(self.plane.rank)} is not a consumer of channel "
                f"'{self.name}' (consumers: ranks {list(self._spec.consumers)})"
            )
        if max_items is None and target_weight is None:
            max_items = 1
        self._end_busy()
        taken = self._take(max_items, target_weight, key)
        if not taken:
            taken = [self._wait_for_item(key, timeout)]
            taken += self._take(
                None if max_items is None else max_items - 1,
                None if target_weight is None else target_weight - taken[0].weight,
                key,
            )
        self._acknowledge(taken)
        self._busy_since = time.monotonic()
        self._pending_weight = sum(r.weight for r in taken)
        return [r.value for r in taken]

    def _end_busy(self) -> None:
        """The time since the last get returned was spent processing: update the rate."""
        if self._busy_since is None:
            return
        busy = time.monotonic() - self._busy_since
        self._busy_since = None
        if busy > 0 and self._pending_weight > 0:
            rate = self._pending_weight / busy
            self._rate = rate if self._rate is None else 0.7 * self._rate + 0.3 * rate

    def _receive_available(self, sources: set[int] | None = None) -> bool:
        got = False
        for source in sorted(sources or set(self._spec.producers) | self._forwarders):
            while True:
                found, message = self.plane.try_recv(source, self._item_tag)
                if not found:
                    break
                got = True
                item_id, key, weight, value, origin = message
                if item_id >= 0:
                    self._queue.append(_Received(item_id, origin, key, weight, value))
                else:
                    self._ended.add((source, item_id))
        return got

    def _finished(self) -> bool:
        """Every producer closed and every former consumer forwarded what it held."""
        return all((p, _END) in self._ended for p in self._spec.producers) and all(
            (f, _FORWARDED) in self._ended for f in self._forwarders
        )

    def _take(self, max_items: int | None, target_weight: float | None, key: Any) -> list[_Received]:
        self._receive_available()
        taken: list[_Received] = []
        weight = 0.0
        for received in list(self._queue):
            if max_items is not None and len(taken) >= max_items:
                break
            if target_weight is not None and taken and weight >= target_weight:
                break
            if key is not None and received.key != key:
                continue
            self._queue.remove(received)
            taken.append(received)
            weight += received.weight
        return taken

    def _wait_for_item(self, key: Any, timeout: float | None) -> _Received:
        start = time.monotonic()
        self._flush_acks(force=True)
        self.plane.flush()
        backoff = Backoff(spin=1e-3)
        try:
            while True:
                taken = self._take(1, None, key)
                if taken:
                    return taken[0]
                if self._finished():
                    raise EndOfStream(
                        f"channel '{self.name}' is closed by every producer and has no "
                        f"{'more items' if key is None else f'items with key {key!r}'}"
                    )
                if timeout is not None and time.monotonic() - start > timeout:
                    raise CommTimeoutError(
                        f"{self.plane.directory.name_of(self.plane.rank)} waited {timeout:.1f} s "
                        f"for an item of channel '{self.name}' from producers "
                        f"{list(self._spec.producers)}"
                    )
                backoff.sleep()
        finally:
            self._get_wait_s += time.monotonic() - start

    def _acknowledge(self, taken: list[_Received]) -> None:
        for received in taken:
            self._served_items += 1
            self._served_weight += received.weight
            self._acks.setdefault(received.producer, []).append(received.item_id)
        self._flush_acks(force=False)

    def _flush_acks(self, force: bool) -> None:
        now = time.monotonic()
        if not self._acks or (not force and now - self._last_ack_flush < _ACK_FLUSH_S):
            return
        for producer, item_ids in self._acks.items():
            self.plane.isend((item_ids, self._rate), producer, self._ack_tag)
        self._acks = {}
        self._last_ack_flush = now
        self.plane.flush()

    # -- re-partition ------------------------------------------------------------------------
    def on_directory_change(
        self, old: ChannelSpec | None, new: ChannelSpec | None, timeout: float = 120.0
    ) -> None:
        """Follow a placement change. Producers fence consumers that left; a consumer that left
        takes in everything sent to it up to those fences and passes it on to the remaining
        consumers; the remaining consumers wait for its hand-over before they can end. Items
        are neither lost nor delivered twice."""
        if old is None or new is None:
            if new is not None:
                self._spec = new
                self._refresh_views()
            return
        me = self.plane.rank
        removed = set(old.consumers) - set(new.consumers)
        self._spec = new
        self._refresh_views()
        self._ack_sources |= set(new.consumers)
        if me in old.producers:
            for consumer in sorted(removed):
                self.plane.isend((_FENCE, None, 0.0, None, me), consumer, self._item_tag)
            if self._closed:  # consumers that joined after close still need the end marker
                for consumer in sorted(set(new.consumers) - set(old.consumers)):
                    self.plane.isend((_END, None, 0.0, None, me), consumer, self._item_tag)
            self._key_owner = {k: r for k, r in self._key_owner.items() if r not in removed}
            self.plane.flush()
        if me in new.consumers:
            self._forwarders |= removed
        if me in removed:
            self._hand_over(old, new, timeout)

    def _hand_over(self, old: ChannelSpec, new: ChannelSpec, timeout: float) -> None:
        self._flush_acks(force=True)
        producers = set(old.producers) | self._forwarders
        start = time.monotonic()
        backoff = Backoff()
        while not all({(p, _FENCE), (p, _FORWARDED), (p, _END)} & self._ended for p in producers):
            if self._receive_available(producers):
                backoff.reset()
            elif time.monotonic() - start > timeout:
                raise CommTimeoutError(
                    f"{self.plane.directory.name_of(self.plane.rank)} left channel '{self.name}' "
                    f"and waited {timeout:.0f} s for producers {sorted(producers)} to stop sending"
                )
            else:
                backoff.sleep()
        targets = [ConsumerView(i, rank) for i, rank in enumerate(new.consumers)]
        handles = []
        for received in self._queue:
            view = targets[checked_choice(self._policy, ItemInfo(received.weight, received.key), targets)]
            view.queued_items += 1
            view.queued_weight += received.weight
            message = (received.item_id, received.key, received.weight, received.value, received.producer)
            handles.append(self.plane.isend(message, view.rank, self._item_tag))
        self._forwarded_items += len(self._queue)
        self._queue.clear()
        for rank in new.consumers:
            handles.append(
                self.plane.isend((_FORWARDED, None, 0.0, None, self.plane.rank), rank, self._item_tag)
            )
        self.plane.flush()
        for handle in handles:
            handle.wait(timeout)

    def qsize(self) -> int:
        """Items here and not yet taken (consumer) plus items out and unacknowledged (producer)."""
        if self.is_consumer:
            self._receive_available()
        if self.is_producer:
            self._take_acks()
        return len(self._queue) + len(self._outstanding)

    def stats(self) -> dict[str, Any]:
        """Producer view of every consumer, and this rank's own consumer figures."""
        if self.is_producer:
            self._take_acks()
        return {
            "channel": self.name,
            "rank": self.plane.rank,
            "consumers": [
                {
                    "rank": v.rank,
                    "queued_items": v.queued_items,
                    "queued_weight": v.queued_weight,
                    "served_items": v.served_items,
                    "served_weight": v.served_weight,
                    "rate": v.rate,
                }
                for v in sorted(self._views.values(), key=lambda v: v.index)
            ]
            if self.is_producer
            else [],
            "put_wait_s": self._put_wait_s,
            "outstanding": len(self._outstanding),
            "served_items": self._served_items,
            "served_weight": self._served_weight,
            "get_wait_s": self._get_wait_s,
            "rate": self._rate,
            "queued_here": len(self._queue),
            "forwarded_items": self._forwarded_items,
        }
