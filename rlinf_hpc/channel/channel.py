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
import weakref
from collections import Counter, deque
from typing import Any

from rlinf_hpc.channel.consumer import ConsumerSide, EndOfStream, _Received
from rlinf_hpc.channel.policies import ConsumerView, ItemInfo, checked_choice, resolve_policy
from rlinf_hpc.channel.producer import ChannelFull, ProducerSide
from rlinf_hpc.channel.protocol import END, FENCE, FORWARDED
from rlinf_hpc.comm import Backoff, ChannelSpec, DataPlane
from rlinf_hpc.errors import CommTimeoutError

__all__ = ["Channel", "ChannelFull", "EndOfStream", "LostItemsError"]

#: How long a retiring producer waits for acknowledgements still on the way.
RETIRE_GRACE_S = 5.0

#: Consumer rates this rank's producers measured, per data plane and channel lineage: a new
#: channel of a lineage (a pipeline stream, one per step) starts from them. Without them every
#: step's stream assumed every consumer as fast as the fastest until its first acknowledgement,
#: and a short stream (a few micro-batches) was spread as if the consumers were equal.
_LEARNT: weakref.WeakKeyDictionary[DataPlane, dict[str, dict[int, float]]] = weakref.WeakKeyDictionary()


class LostItemsError(RuntimeError):
    """A channel was removed while items it carried were never consumed."""


class Channel(ProducerSide, ConsumerSide):
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
        if hasattr(self._policy, "producer_rank"):
            self._policy.producer_rank = plane.rank
        self._views: dict[int, ConsumerView] = {}
        lineage = self._spec.lineage
        self._learnt: dict[int, float] = (
            {} if lineage is None else _LEARNT.setdefault(plane, {}).setdefault(lineage, {})
        )
        self._outstanding: dict[int, tuple[int, float]] = {}
        self._key_owner: dict[Any, int] = {}
        self._next_id = 0
        self._closed = False
        self._put_wait_s = 0.0
        # consumer side
        self._queue: deque[_Received] = deque()
        self._ended: set[int] = set()
        self._forwarders: set[int] = set()  # former consumers passing their items on
        self._pending_gets: deque[tuple[list[Any], int | None, float | None, Any]] = deque()
        self._ack_sources: set[int] = set(self._spec.consumers)
        self._acks: dict[int, list[float]] = {}
        self._held_acks: dict[int, list[float]] = {}
        self._last_ack_flush = time.monotonic()
        self._busy_since: float | None = None
        self._pending_weight = 0.0
        self._pending_by_producer: dict[int, float] = {}
        self._busy_by_producer: dict[int, float] = {}
        self._unrated_reports: set[int] = set()
        self._rate: float | None = None
        self._served_items = 0
        self._served_weight = 0.0
        self._get_wait_s = 0.0
        self._forwarded_items = 0
        self._refresh_views()
        # Acknowledgements owed upstream leave whenever this rank waits on anything, so that
        # a rank blocked downstream never holds back the producers feeding it.
        plane.add_poll_hook(self._flush_owed_acks)

    def _flush_owed_acks(self) -> None:
        if self._acks:
            self._flush_acks(force=True)

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
            view = self._views.get(rank) or ConsumerView(index, rank, rate=self._learnt.get(rank))
            view.index, view.share = index, share
            views[rank] = view
        self._views = views

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
                self.plane.isend((FENCE, None, 0.0, None, me), consumer, self._item_tag)
            if self._closed:  # consumers that joined after close still need the end marker
                for consumer in sorted(set(new.consumers) - set(old.consumers)):
                    self.plane.isend((END, None, 0.0, None, me), consumer, self._item_tag)
            self._key_owner = {k: r for k, r in self._key_owner.items() if r not in removed}
            self.plane.flush()
        if me in new.consumers:
            self._forwarders |= removed
        if me in removed:
            self._hand_over(old, new, timeout)

    def _hand_over(self, old: ChannelSpec, new: ChannelSpec, timeout: float) -> None:
        self._flush_acks(force=True, final=True)
        producers = set(old.producers) | self._forwarders
        start = time.monotonic()
        backoff = Backoff()
        while not all({(p, FENCE), (p, FORWARDED), (p, END)} & self._ended for p in producers):
            if self._receive_available(producers):
                backoff.reset()
            elif time.monotonic() - start > timeout:
                raise CommTimeoutError(
                    f"{self.plane.directory.name_of(self.plane.rank)} left channel '{self.name}' "
                    f"and waited {timeout:.0f} s for producers {sorted(producers)} to stop sending"
                )
            else:
                self.plane.poll()  # keep taking in what others send here (no cycle deadlocks)
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
                self.plane.isend((FORWARDED, None, 0.0, None, self.plane.rank), rank, self._item_tag)
            )
        self.plane.flush()
        for handle in handles:
            handle.wait(timeout)

    def downstream_wait_s(self) -> float:
        """Producer: the longest time any consumer has spent waiting for items so far (as
        reported by its acknowledgements). A rising value means downstream starves."""
        self._take_acks()
        return max((v.waited_s for v in self._views.values()), default=0.0)

    def retire(self, grace_s: float = RETIRE_GRACE_S) -> None:
        """The channel is being removed. A producer takes in the acknowledgements still on the
        way (for up to ``grace_s``); items that no consumer took by then are lost, and so are
        items queued on a consumer that never took them: `LostItemsError` says how many, from
        which producer, on which consumer. Losing items is never silent."""
        lost: list[str] = []
        name_of = self.plane.directory.name_of
        self._flush_acks(force=True, final=True)  # producers retiring at the same moment wait for these
        if self.is_producer:
            start = time.monotonic()
            backoff = Backoff()
            while self._outstanding and time.monotonic() - start < grace_s:
                if not self._take_acks():
                    self.plane.poll()
                    backoff.sleep()
            per_consumer = Counter(consumer for consumer, _ in self._outstanding.values())
            lost += [
                f"{count} item(s) sent by {name_of(self.plane.rank)} to {name_of(consumer)} were never "
                "taken by it"
                for consumer, count in sorted(per_consumer.items())
            ]
        if self.is_consumer:
            self._receive_available()  # what has arrived counts as queued here
            per_producer = Counter(received.producer for received in self._queue)
            lost += [
                f"{count} item(s) from {name_of(producer)} were still queued on {name_of(self.plane.rank)}"
                for producer, count in sorted(per_producer.items())
            ]
        if lost:
            raise LostItemsError(
                f"channel '{self.name}' was removed with items nobody consumed: {'; '.join(lost)}. "
                "A consumer stopped taking items before end-of-stream (or left without handing "
                "them over): consume until EndOfStream"
            )

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
                    "busy_s": v.busy_s,
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
