"""The consumer half of a channel: receiving, taking, acknowledging, async gets, device moves."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from rlinf_hpc.channel.protocol import ACK_FLUSH_S, BULK, END, FORWARDED, move_tensors
from rlinf_hpc.comm import Backoff, ChannelSpec, DataPlane, WorkHandle
from rlinf_hpc.errors import CommTimeoutError


class EndOfStream(Exception):
    """Every producer closed the channel and this consumer has taken every item."""


@dataclass
class _Received:
    item_id: int
    producer: int  # where the acknowledgement goes (the item's origin, also when forwarded)
    key: Any
    weight: float
    value: Any


class ConsumerSide:
    """Consumer methods of `Channel` (state is set up in `Channel.__init__`)."""

    plane: DataPlane
    name: str
    _spec: ChannelSpec
    _item_tag: tuple[str, str, str]
    _ack_tag: tuple[str, str, str]

    _queue: deque[_Received]
    _ended: set[tuple[int, int]]
    _forwarders: set[int]
    _pending_gets: deque[tuple[list[Any], int | None, float | None, Any]]
    _acks: dict[int, list[int]]
    #: Acknowledgements owed to producers that closed the stream, sent at its end (`_flush_acks`).
    _held_acks: dict[int, list[int]]
    _last_ack_flush: float
    _busy_since: float | None
    _pending_weight: float
    #: Weight of what this rank took last, per producer (it is working on it now), and the busy
    #: seconds it spent on each producer's items it has finished (told in acknowledgements).
    _pending_by_producer: dict[int, float]
    _busy_by_producer: dict[int, float]
    #: Producers whose last acknowledgement from here carried no rate yet.
    _unrated_reports: set[int]
    _rate: float | None
    _served_items: int
    _served_weight: float
    _get_wait_s: float

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
        add_to_last: bool = False,
        block: bool = True,
    ) -> list[Any]:
        """At least one item, then as many as are here up to ``max_items`` items or until
        their weights reach ``target_weight``. ``block=False``: what is here now, possibly
        nothing (an engine admitting requests into free slots between its steps).

        ``add_to_last=True``: these items complete the batch the last get returned (a micro-
        batch filled in several gets), so the time since then was not spent processing. The
        channel measures this rank's rate from the time between gets; counted as processing,
        that instant would read as a huge rate and producers would flood this rank."""
        self._check_consumer()
        if max_items is None and target_weight is None:
            max_items = 1
        if not add_to_last:
            self._end_busy()
        taken = self._take(max_items, target_weight, key)
        if not taken and not block:
            if self._finished():
                raise self._end_of_stream(f"channel '{self.name}' is closed by every producer")
            self._report_idle()
            self._flush_acks(force=True)
            return []
        if not taken:
            taken = [self._wait_for_item(key, timeout)]
            remaining = None if target_weight is None else target_weight - taken[0].weight
            if remaining is None or remaining > 0:
                more = None if max_items is None else max_items - 1
                taken += self._take(more, remaining, key)
        self._start_busy(taken)
        self._acknowledge(taken)
        return [r.value for r in taken]

    def get_async(
        self, max_items: int = 1, target_weight: float | None = None, key: Any = None
    ) -> WorkHandle:
        """Start a get; ``wait()`` returns the list of items (raises `EndOfStream` at the end).
        Handles are served in the order they were made."""
        self._check_consumer()
        slot: list[Any] = []
        self._pending_gets.append((slot, max_items, target_weight, key))

        def test() -> bool:
            if not slot:
                self._serve_pending_gets()
            return bool(slot)

        def result() -> Any:
            if isinstance(slot[0], EndOfStream):
                raise slot[0]
            return slot[0]

        return WorkHandle(
            test,
            result,
            lambda: (
                f"{self.plane.directory.name_of(self.plane.rank)} waited for an item of channel "
                f"'{self.name}' from producers {list(self._spec.producers)}"
            ),
            self.plane.poll,
        )

    def _serve_pending_gets(self) -> None:
        """Fill posted `get_async` handles in the order they were made, as far as possible."""
        while self._pending_gets:
            slot, max_items, target_weight, key = self._pending_gets[0]
            taken = self._take(max_items, target_weight, key)
            if taken:
                self._end_busy()  # the items of an earlier async get count as done
                self._start_busy(taken)
                self._acknowledge(taken)
                slot.append([r.value for r in taken])
            elif self._finished():
                slot.append(self._end_of_stream(f"channel '{self.name}' is closed by every producer"))
            else:
                self._report_idle()
                self._flush_acks(force=True)
                return
            self._pending_gets.popleft()

    def prefetch(self, count: int) -> int:
        """Move the next ``count`` queued items onto this rank's device now, so that `get`
        returns them ready to use. Returns how many items were moved."""
        self._receive_available()
        moved = 0
        for received in list(self._queue)[:count]:
            received.value = move_tensors(received.value, self.plane.device)
            moved += 1
        return moved

    def offload(self) -> int:
        """Move every queued item to host memory (device memory pressure). Returns the count."""
        for received in self._queue:
            received.value = move_tensors(received.value, "cpu")
        return len(self._queue)

    def _offload_under_pressure(self) -> None:
        """Move queued items to host memory once the device is fuller than ``offload_above``."""
        limit = self._spec.offload_above
        if limit is None or not self.plane.device.startswith("cuda") or not self._queue:
            return
        import torch

        device = torch.device(self.plane.device)
        total = torch.cuda.get_device_properties(device).total_memory
        if torch.cuda.memory_allocated(device) > limit * total:
            self.offload()

    def _check_consumer(self) -> None:
        if not self.is_consumer:
            raise ValueError(
                f"{self.plane.directory.name_of(self.plane.rank)} is not a consumer of channel "
                f"'{self.name}' (consumers: ranks {list(self._spec.consumers)})"
            )

    def _start_busy(self, taken: list[_Received]) -> None:
        """This rank works on ``taken`` (and on what it took last unless `_end_busy` closed
        that) from now until its next get."""
        self._busy_since = time.monotonic()
        for received in taken:
            self._pending_weight += received.weight
            pending = self._pending_by_producer.get(received.producer, 0.0)
            self._pending_by_producer[received.producer] = pending + received.weight

    def _end_busy(self) -> None:
        """The time since the last get returned was spent processing: update the rate, and
        charge that time to the producers of what was taken (in proportion to weight)."""
        if self._busy_since is None:
            return
        busy = time.monotonic() - self._busy_since
        self._busy_since = None
        if busy > 0 and self._pending_weight > 0:
            rate = self._pending_weight / busy
            self._rate = rate if self._rate is None else 0.7 * self._rate + 0.3 * rate
            for producer, weight in self._pending_by_producer.items():
                spent = self._busy_by_producer.get(producer, 0.0)
                self._busy_by_producer[producer] = spent + busy * weight / self._pending_weight
        self._pending_weight = 0.0
        self._pending_by_producer = {}

    def _receive_available(self, sources: set[int] | None = None) -> bool:
        got = False
        everyone = sorted(sources or set(self._spec.producers) | self._forwarders)
        for source in self.plane.ready_from(everyone, self._item_tag):
            while True:
                found, message = self.plane.try_recv(source, self._item_tag)
                if not found:
                    break
                got = True
                item_id, key, weight, value, origin = message
                if item_id >= 0:
                    self._queue.append(_Received(item_id, origin, key, weight, value))
                    self._offload_under_pressure()
                elif item_id == BULK:  # several items of one producer (`put_many`)
                    self._queue.extend(_Received(i, origin, k, w, v) for i, k, w, v in value)
                    self._offload_under_pressure()
                else:
                    self._ended.add((source, item_id))
        return got

    def _finished(self) -> bool:
        """Every producer closed and every former consumer forwarded what it held."""
        return all((p, END) in self._ended for p in self._spec.producers) and all(
            (f, FORWARDED) in self._ended for f in self._forwarders
        )

    def _take(self, max_items: int | None, target_weight: float | None, key: Any) -> list[_Received]:
        self._receive_available()
        taken: list[_Received] = []
        weight = 0.0
        if key is None:  # plain FIFO: take from the front
            while self._queue and (max_items is None or len(taken) < max_items):
                if target_weight is not None and taken and weight >= target_weight:
                    break
                received = self._queue.popleft()
                taken.append(received)
                weight += received.weight
            return taken
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
        self._report_idle()
        self._flush_acks(force=True)
        self.plane.flush()
        backoff = Backoff(spin=1e-3)
        try:
            while True:
                taken = self._take(1, None, key)
                if taken:
                    return taken[0]
                if self._finished():
                    raise self._end_of_stream(
                        f"channel '{self.name}' is closed by every producer and has no "
                        f"{'more items' if key is None else f'items with key {key!r}'}"
                    )
                if timeout is not None and time.monotonic() - start > timeout:
                    raise CommTimeoutError(
                        f"{self.plane.directory.name_of(self.plane.rank)} waited {timeout:.1f} s "
                        f"for an item of channel '{self.name}' from producers "
                        f"{list(self._spec.producers)}"
                    )
                self.plane.poll()  # keep taking in what others send here (no cycle deadlocks)
                backoff.sleep()
        finally:
            self._get_wait_s += time.monotonic() - start

    def _acknowledge(self, taken: list[_Received]) -> None:
        for received in taken:
            self._served_items += 1
            self._served_weight += received.weight
            self._acks.setdefault(received.producer, []).append(received.item_id)
        # Acknowledgements are held (and coalesced) only while this rank will be back for more
        # within the flush interval. Nothing left here: the producers must learn now that there
        # is room, or this rank idles after the batch it just took. A batch expected to take
        # longer than the interval: a held acknowledgement would keep the producer's room (and
        # its view of this rank) stale for all that time while other consumers run dry.
        expected_s = self._pending_weight / self._rate if self._rate else float("inf")
        self._flush_acks(force=not self._queue or expected_s >= ACK_FLUSH_S)

    def _report_idle(self) -> None:
        """Out of items: a producer that last heard no rate from here gives this rank no
        second item until it does, so tell it (rate, busy time, nothing in hand) once there is
        one; without it a consumer still unmeasured after its first item never got another."""
        if self._rate is not None:
            for producer in self._unrated_reports:
                self._acks.setdefault(producer, [])

    def _flush_acks(self, force: bool, final: bool = False) -> None:
        """Send the acknowledgements owed. Those owed to a producer that has closed the channel
        wait for ``final`` (this rank's end of the stream, a hand-over, the channel's removal):
        it has nothing more to send, so room is no news to it, and one message per take was
        what the rank's engine sent the coordinator (the feed's producer) — ~35 per engine per
        step at 24 emulated ranks with short responses, ahead of the engine's reply in MPI's
        queue to rank 0, which saw every reply of the step ~0.2 s after it was sent."""
        now = time.monotonic()
        if final and self._held_acks:
            for producer, item_ids in self._held_acks.items():
                self._acks.setdefault(producer, []).extend(item_ids)
            self._held_acks = {}
        if not self._acks or (not force and now - self._last_ack_flush < ACK_FLUSH_S):
            return
        for producer, item_ids in self._acks.items():
            if not final and producer != self.plane.rank and (producer, END) in self._ended:
                self._held_acks.setdefault(producer, []).extend(item_ids)
                continue
            ack = (
                item_ids,
                self._rate,
                self._get_wait_s,
                self._busy_by_producer.get(producer, 0.0),
                self._pending_by_producer.get(producer, 0.0),
            )
            if self._rate is None:
                self._unrated_reports.add(producer)
            else:
                self._unrated_reports.discard(producer)
            if producer == self.plane.rank:
                self._apply_ack(producer, ack)
                continue
            self.plane.isend(ack, producer, self._ack_tag)
        self._acks = {}
        self._last_ack_flush = now
        self.plane.flush()

    def _end_of_stream(self, message: str) -> EndOfStream:
        """The stream ended here: what is owed upstream leaves now."""
        self._flush_acks(force=True, final=True)
        return EndOfStream(message)
