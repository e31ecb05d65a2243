"""Channel checks on every rank under ``mpiexec -n N`` (N >= 3): rank 0 produces, the others
consume (run by tests/test_channel_mpi.py). Failures abort the job; nothing hangs."""

from __future__ import annotations

import sys
import time

import torch
from harness import run_checks

from rlinf_hpc.channel import (
    Channel,
    ChannelFull,
    EndOfStream,
    LoadBalancePolicy,
    LostItemsError,
    attach_channels,
    channel_for,
    resolve_policy,
)
from rlinf_hpc.channel.protocol import END
from rlinf_hpc.comm import ChannelSpec, CommOptions, DataPlane, Directory
from rlinf_hpc.comm.mpi import world
from rlinf_hpc.errors import CommTimeoutError, UserError

torch.set_num_threads(1)


class LastConsumer(LoadBalancePolicy):
    """A user policy: always the last consumer."""

    def select_consumer(self, item, consumers):  # noqa: ANN001, ANN201
        return len(consumers) - 1


class Broken(LoadBalancePolicy):
    def select_consumer(self, item, consumers):  # noqa: ANN001, ANN201
        return 99


def make_plane(size: int, **specs: dict) -> DataPlane:
    consumers = tuple(range(1, size))
    channels = {name: ChannelSpec(name, (0,), consumers, **spec) for name, spec in specs.items()}
    channels["local"] = ChannelSpec("local", (0,), (0,))
    directory = Directory(groups={"consumer": list(consumers)}, world_size=size, channels=channels)
    return DataPlane(directory, options=CommOptions())


def drain(channel: Channel) -> list:
    got = []
    while True:
        try:
            got.append(channel.get(timeout=60))
        except EndOfStream:
            return got


def check_every_item_once_in_order(plane: DataPlane, size: int) -> None:
    for policy in ("round_robin", "shortest_queue", "performance_aware", "channel_checks:LastConsumer"):
        channel = Channel(plane, f"c-{policy}")
        if plane.rank == 0:
            for i in range(200):
                channel.put({"i": i, "t": torch.full((4,), i)}, weight=1 + i % 3)
            channel.close()
        else:
            got = drain(channel)
            ids = [g["i"] for g in got]
            assert ids == sorted(ids), f"{policy}: out of order on rank {plane.rank}"
            assert all(int(g["t"][0]) == g["i"] for g in got)
            if policy == "channel_checks:LastConsumer":
                assert len(ids) == (200 if plane.rank == size - 1 else 0)
        everything = world().gather([] if plane.rank == 0 else ids, root=0)
        if plane.rank == 0:
            flat = sorted(i for part in everything for i in part)
            assert flat == list(range(200)), f"{policy}: items lost or duplicated"
            # stats agree with what the consumers took, once their last acknowledgements are in
            per_consumer = [len(part) for part in everything[1:]]
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                stats = channel.stats()
                if stats["outstanding"] == 0:
                    break
                time.sleep(0.01)
            assert stats["outstanding"] == 0, stats
            assert [c["served_items"] for c in stats["consumers"]] == per_consumer, stats
            assert all(c["queued_items"] == 0 and c["queued_weight"] == 0 for c in stats["consumers"])
            weights = {r: 0.0 for r in range(1, size)}
            for rank, part in zip(range(1, size), everything[1:], strict=True):
                weights[rank] = float(sum(1 + i % 3 for i in part))
            assert [c["served_weight"] for c in stats["consumers"]] == list(weights.values())


def check_weights_and_batches(plane: DataPlane, size: int) -> None:
    channel = Channel(plane, "batches")
    if plane.rank == 0:
        for i in range(40 * (size - 1)):
            channel.put(i, weight=2.0, key="k")  # one key: every item goes to one consumer
        channel.close()
    else:
        got = []
        while True:
            try:
                batch = channel.get_batch(target_weight=7.0, timeout=60)
            except EndOfStream:
                break
            assert 1 <= len(batch) <= 4, batch  # weights of 2: at most 4 reach 7
            got += batch
        counts = world().allgather(len(got))
        assert sorted(counts[1:])[-1] == 40 * (size - 1) and sum(counts[1:]) == 40 * (size - 1)
        assert got == sorted(got)
        return
    world().allgather(0)


def check_backpressure(plane: DataPlane, size: int) -> None:
    channel = Channel(plane, "small")
    if plane.rank == 0:
        for i in range(4):
            channel.put(i, block=False)
        assert channel.qsize() == 4  # sent, not yet acknowledged
        try:
            channel.put(99, block=False)
        except ChannelFull as exc:
            assert "capacity 4" in str(exc)
        else:
            raise AssertionError("a full channel accepted a non-blocking put")
        world().Barrier()  # consumers start taking now
        start = time.monotonic()
        channel.put(4, timeout=60)  # blocks until a consumer acknowledges
        assert time.monotonic() - start < 30
        channel.close()
    else:
        world().Barrier()
        drain(channel)


def check_local_and_async(plane: DataPlane, size: int) -> None:
    if plane.rank == 0:  # producer and consumer of "local": the object is handed over, no copy
        local = Channel(plane, "local")
        item = {"t": torch.ones(3)}
        local.put(item)
        assert local.get(timeout=5) is item
        local.close()
        try:
            local.get(timeout=5)
        except EndOfStream:
            pass
        else:
            raise AssertionError("no end of stream on the local channel")
    channel = Channel(plane, "async")
    if plane.rank == 0:
        world().Barrier()
        for i in range(3):
            channel.put(i, key="only")  # one key: all to one consumer
        channel.close()
    else:
        handles = [channel.get_async() for _ in range(2)]
        world().Barrier()
        owner = None
        try:
            first = handles[0].wait(30)
            owner = True
        except EndOfStream:
            owner = False
        if owner:
            assert first == [0] and handles[1].wait(30) == [1]
            assert channel.get_async().wait(30) == [2]
        try:
            channel.get_async().wait(30)
        except EndOfStream:
            pass
        else:
            raise AssertionError("get_async after the end returned an item")
        owners = world().allgather(owner)
        assert sum(bool(o) for o in owners[1:]) == 1
        return
    world().allgather(None)


def check_bad_input(plane: DataPlane, size: int) -> None:
    channel = Channel(plane, "bad")
    if plane.rank == 0:
        for weight in (-1.0, float("nan"), "heavy"):
            try:
                channel.put(1, weight=weight)
            except ValueError as exc:
                assert "weight must be a number >= 0" in str(exc)
            else:
                raise AssertionError(f"weight {weight!r} accepted")
        try:
            Channel(plane, "nope")
        except ValueError as exc:
            assert "no channel 'nope'" in str(exc) and "channels:" in str(exc)
        else:
            raise AssertionError("unknown channel accepted")
        broken = Channel(plane, "broken")
        try:
            broken.put(1)
        except ValueError as exc:
            assert "Broken.select_consumer returned 99" in str(exc)
        else:
            raise AssertionError("invalid policy index accepted")
        channel.close()
        try:
            channel.put(1)
        except ValueError as exc:
            assert "after this producer closed it" in str(exc)
        else:
            raise AssertionError("put after close accepted")
        for path in ("no_such_module:Policy", "channel_checks:Nothing", "shortest"):
            try:
                resolve_policy(path)
            except UserError as exc:
                assert path.split(":")[0] in str(exc)
            else:
                raise AssertionError(f"policy {path} accepted")
    else:
        assert drain(channel) == []
        try:  # closed and drained: a clear error, no hang
            channel.get(timeout=5)
        except EndOfStream as exc:
            assert "closed by every producer" in str(exc)
        try:
            channel.put(1)
        except ValueError as exc:
            assert "is not a producer" in str(exc)
        else:
            raise AssertionError("a consumer could put")
        try:
            Channel(plane, "never").get(timeout=0.3)
        except CommTimeoutError as exc:
            assert "for an item of channel 'never' from producers [0]" in str(exc)
        else:
            raise AssertionError("get on an idle channel did not time out")


def check_lost_items_are_reported(size: int) -> None:
    """Rank 1 takes 2 of 5 items and stops; removing the channel raises on the producer (3
    items never taken by rank 1) and on rank 1 (items still queued); a fully drained channel
    retires quietly."""
    specs = {name: ChannelSpec(name, (0,), (1,), capacity=8) for name in ("lossy", "clean")}
    directory = Directory(groups={"consumer": list(range(1, size))}, world_size=size, channels=specs)
    plane = DataPlane(directory)
    attach_channels(plane)
    lossy, clean = channel_for(plane, "lossy"), channel_for(plane, "clean")
    if plane.rank == 0:
        for i in range(5):
            lossy.put(i, timeout=30)
            clean.put(i, timeout=30)
        lossy.close()
        clean.close()
    elif plane.rank == 1:
        assert [lossy.get(timeout=30) for _ in range(2)] == [0, 1]
        assert drain(clean) == list(range(5))
        time.sleep(0.2)  # the rest of "lossy" arrives and waits here, never taken
    world().Barrier()
    gone = Directory(groups=directory.groups, world_size=size, version=1, channels={"clean": specs["clean"]})
    if plane.rank in (0, 1):
        try:
            plane.set_directory(gone)
        except LostItemsError as error:
            text = str(error)
            assert "channel 'lossy'" in text, text
            if plane.rank == 0:
                assert (
                    "3 item(s) sent by rank 0 (coordinator) to rank 1 (consumer:0) were never taken" in text
                )
            else:
                assert "3 item(s) from rank 0 (coordinator) were still queued on rank 1" in text, text
        else:
            raise AssertionError("a channel with unconsumed items was removed silently")
    else:
        plane.set_directory(gone)
    empty = Directory(groups=directory.groups, world_size=size, version=2)
    plane.set_directory(empty)  # "clean" was drained: no error


def check_rates_carry_over_a_lineage(size: int) -> None:
    """A producer learns consumer rates on one channel of a lineage; the next channel of that
    lineage starts from them (a channel of another lineage, or none, does not)."""
    consumers = tuple(range(1, size))
    specs = {
        name: ChannelSpec(name, (0,), consumers, "performance_aware", 64, lineage=lineage)
        for name, lineage in (("gen1", "gen"), ("gen2", "gen"), ("solo", None))
    }
    plane = DataPlane(Directory(groups={"consumer": list(consumers)}, world_size=size, channels=specs))
    first = Channel(plane, "gen1")
    if plane.rank == 0:
        for i in range(20 * len(consumers)):
            first.put(i, weight=1.0, timeout=30)
        first.close()
    else:
        while True:
            try:
                first.get(timeout=60)
            except EndOfStream:
                break
            time.sleep(1e-3 * plane.rank)  # consumer r takes r ms an item
    world().Barrier()
    if plane.rank == 0:
        first._take_acks()
        learnt = {rank: view.rate for rank, view in first._views.items()}
        assert all(learnt.values()), learnt
        assert learnt[1] > 1.5 * learnt[size - 1], learnt  # the fastest measured as faster
        second = Channel(plane, "gen2")
        assert {rank: view.rate for rank, view in second._views.items()} == learnt
        assert all(view.rate is None for view in Channel(plane, "solo")._views.values())


def check_unequal_consumers_share_a_small_capacity(size: int) -> None:
    """performance_aware at capacity = number of consumers, consumer r taking r^2 x 2 ms an
    item: every consumer keeps getting work (none hoards the capacity while unmeasured, none
    is starved once measured) and the busy seconds they report to the producer agree with
    their own clocks and are balanced."""
    consumers = tuple(range(1, size))
    spec = ChannelSpec("unequal", (0,), consumers, "performance_aware", len(consumers))
    plane = DataPlane(
        Directory(groups={"consumer": list(consumers)}, world_size=size, channels={"unequal": spec})
    )
    channel = Channel(plane, "unequal")
    busy = 0.0
    if plane.rank == 0:
        for i in range(40 * len(consumers)):
            channel.put(i, weight=1.0, timeout=60)
        channel.close()
    else:
        while True:
            try:
                channel.get(timeout=60)
            except EndOfStream:
                break
            started = time.monotonic()
            time.sleep(2e-3 * plane.rank**2)
            busy += time.monotonic() - started
    own = world().gather(busy, root=0)
    world().Barrier()
    if plane.rank == 0:
        channel._take_acks()
        views = sorted(channel._views.values(), key=lambda v: v.rank)
        served = [v.served_items for v in views]
        assert min(served) >= 3 and sum(served) == 40 * len(consumers), served
        reported = [v.busy_s for v in views]
        spread = (max(own[1:]) - min(own[1:])) / (sum(own[1:]) / len(consumers))
        assert spread < 0.5, (own, served)
        # what a consumer reports trails its own clock by its last item (not reported after the
        # end) and includes its own per-item overhead around the sleep: up to 0.5 ms an item on a
        # loaded box (CI saw 0.25 ms: 12% over the 2 ms items of consumer 1)
        for view, mine in zip(views, own[1:], strict=True):
            overhead = max(0.1 * mine, 0.5e-3 * view.served_items) + 2e-3
            assert mine - 2 * 2e-3 * view.rank**2 <= view.busy_s <= mine + overhead, (reported, own, served)


def check_batch_filled_in_several_gets_measures_its_rate(size: int) -> None:
    """A micro-batch filled in two gets (``add_to_last``) is timed from when it was complete:
    4 items processed in 0.1 s read as ~40 items/s, not as the huge rate of the instant between
    the two gets (which made producers flood a batch-bound stage)."""
    spec = ChannelSpec("refill", (0,), (1,), "performance_aware", 16)
    plane = DataPlane(Directory(groups={"consumer": [1]}, world_size=size, channels={"refill": spec}))
    channel = Channel(plane, "refill")
    if plane.rank == 0:
        channel.put_batch([0, 1], timeout=30)
        plane.send("two sent", 1, tag="refill-two", timeout=30)
        assert plane.recv(1, tag="refill-partial", timeout=30) == "took two"
        time.sleep(0.05)  # the consumer waits inside its second get meanwhile
        channel.put_batch([2, 3, 4], timeout=30)
        channel.close()
    elif plane.rank == 1:
        assert plane.recv(0, tag="refill-two", timeout=30) == "two sent"
        batch = channel.get_batch(max_items=4, timeout=30)
        assert batch == [0, 1], batch
        plane.send("took two", 0, tag="refill-partial", timeout=30)
        while len(batch) < 4:
            batch += channel.get_batch(max_items=4 - len(batch), timeout=30, add_to_last=True)
        assert batch == [0, 1, 2, 3], batch
        time.sleep(0.1)  # processing the micro-batch
        assert channel.get(timeout=30) == 4
        rate = channel.stats()["rate"]
        assert 25 < rate < 45, rate  # 4 items / 0.1 s
        assert drain(channel) == []
    world().Barrier()


def check_non_blocking_get_returns_what_is_here(size: int) -> None:
    """``get_batch(block=False)``: nothing while nothing arrived (no wait), what is here up to
    ``max_items``, and EndOfStream once every producer closed and all was taken."""
    spec = ChannelSpec("poll", (0,), (1,), "performance_aware", 16)
    plane = DataPlane(Directory(groups={"consumer": [1]}, world_size=size, channels={"poll": spec}))
    channel = Channel(plane, "poll")
    if plane.rank == 0:
        assert plane.recv(1, tag="poll-empty", timeout=30) == "saw nothing"
        channel.put_batch([0, 1, 2], timeout=30)
        plane.send("three sent", 1, tag="poll-three", timeout=30)
        channel.close()
    elif plane.rank == 1:
        started = time.monotonic()
        assert channel.get_batch(max_items=8, block=False) == []
        assert time.monotonic() - started < 0.5
        plane.send("saw nothing", 0, tag="poll-empty", timeout=30)
        assert plane.recv(0, tag="poll-three", timeout=30) == "three sent"
        got: list[int] = []
        deadline = time.monotonic() + 30
        while len(got) < 3 and time.monotonic() < deadline:  # the items may still be in flight
            got += channel.get_batch(max_items=2, block=False)
            assert len(got) <= 3
            time.sleep(0.001)
        assert got == [0, 1, 2], got
        deadline = time.monotonic() + 30
        while True:  # the end-of-stream marker may arrive after the items
            try:
                assert channel.get_batch(max_items=2, block=False) == []
            except EndOfStream:
                break
            assert time.monotonic() < deadline, "no EndOfStream"
            time.sleep(0.001)
    world().Barrier()


def check_acks_to_a_closed_producer_leave_with_the_stream_end(size: int) -> None:
    """A consumer acknowledges what it takes from a producer that has closed the channel only
    when its stream ends (one message then, not one per take: an engine's acknowledgements to
    the coordinator's feed delayed the engine's reply behind them), and then all of them."""
    spec = ChannelSpec("closed-acks", (0,), (1,), "performance_aware", 16)
    plane = DataPlane(Directory(groups={"consumer": [1]}, world_size=size, channels={"closed-acks": spec}))
    channel = Channel(plane, "closed-acks")
    if plane.rank == 0:
        channel.put_batch(list(range(10)), timeout=30)
        channel.close()
        assert plane.recv(1, tag="closed-taken", timeout=30) == "taken"
        time.sleep(0.2)  # acknowledgements sent per take would have arrived by now
        channel._take_acks()
        assert len(channel._outstanding) == 10, channel._outstanding
        plane.send("checked", 1, tag="closed-checked", timeout=30)
        assert plane.recv(1, tag="closed-ended", timeout=30) == "ended"
        deadline = time.monotonic() + 30
        while channel._outstanding:
            assert time.monotonic() < deadline, f"acknowledgements never came: {channel._outstanding}"
            channel._take_acks()
            time.sleep(0.001)
        channel.retire()  # nothing lost
    elif plane.rank == 1:
        deadline = time.monotonic() + 30
        while (0, END) not in channel._ended:  # every item is here before the end marker
            assert time.monotonic() < deadline, "no end marker"
            channel._receive_available()
            time.sleep(0.001)
        got = []
        while len(got) < 10:
            got += channel.get_batch(max_items=1, block=False)
        assert got == list(range(10)), got
        plane.send("taken", 0, tag="closed-taken", timeout=30)
        assert plane.recv(0, tag="closed-checked", timeout=30) == "checked"
        try:
            channel.get_batch(max_items=1, block=False)
            raise AssertionError("no EndOfStream after the last item")
        except EndOfStream:
            pass
        plane.send("ended", 0, tag="closed-ended", timeout=30)
        channel.retire()
    world().Barrier()


def check_put_many(plane: DataPlane, size: int) -> None:
    """`put_many`: each item once and in order per consumer, one message per consumer, no more
    items than the capacity has room for; `put_batch` over a small capacity waits for room."""
    many, room = Channel(plane, "many"), Channel(plane, "many-small")
    if plane.rank == 0:
        sent_before = plane.stats["envelopes_sent"]
        count, handles = many.put_many(
            [{"i": i, "t": torch.full((2,), i)} for i in range(60)], [1.0 + i % 2 for i in range(60)]
        )
        assert count == 60 and len(handles) == size - 1, (count, len(handles))
        plane.flush()
        for handle in handles:
            handle.wait(60)
        assert plane.stats["envelopes_sent"] - sent_before <= size - 1, plane.stats
        count, handles = room.put_many(list(range(10)))  # capacity 4: the first 4 only
        assert count == 4, count
        for handle in handles:
            handle.wait(60)
        assert room.put_many([99])[0] == 0  # full: nothing put, nothing raised
        many.close()
        world().Barrier()  # consumers start taking now
        room.put_batch(list(range(4, 30)), timeout=60)  # waits for room as consumers take
        room.close()
        got, small = [], []
    else:
        world().Barrier()
        got, small = drain(many), drain(room)
        assert [g["i"] for g in got] == sorted(g["i"] for g in got)
        assert all(int(g["t"][0]) == g["i"] for g in got)
        assert small == sorted(small)
    everything = world().gather(([g["i"] for g in got], small), root=0)
    if plane.rank == 0:
        assert sorted(i for part, _ in everything for i in part) == list(range(60))
        assert sorted(i for _, part in everything for i in part) == list(range(30))
        assert all(part for part, _ in everything[1:]), "put_many left a consumer out"


def main() -> int:
    comm = world()
    size = comm.Get_size()
    assert size >= 3
    specs = {
        f"c-{p}": {"policy": p}
        for p in ("round_robin", "shortest_queue", "performance_aware", "channel_checks:LastConsumer")
    }
    specs |= {
        "batches": {},
        "small": {"capacity": 4},
        "many": {},
        "many-small": {"capacity": 4},
        "async": {},
        "bad": {},
        "never": {},
        "broken": {"policy": "channel_checks:Broken"},
    }
    plane = make_plane(size, **specs)
    checks = [
        ("every_item_once_in_order", lambda: check_every_item_once_in_order(plane, size)),
        ("weights_and_batches", lambda: check_weights_and_batches(plane, size)),
        ("backpressure", lambda: check_backpressure(plane, size)),
        ("put_many", lambda: check_put_many(plane, size)),
        ("local_and_async", lambda: check_local_and_async(plane, size)),
        ("bad_input", lambda: check_bad_input(plane, size)),
        ("lost_items_are_reported", lambda: check_lost_items_are_reported(size)),
        ("rates_carry_over_a_lineage", lambda: check_rates_carry_over_a_lineage(size)),
        (
            "unequal_consumers_share_a_small_capacity",
            lambda: check_unequal_consumers_share_a_small_capacity(size),
        ),
        ("non_blocking_get_returns_what_is_here", lambda: check_non_blocking_get_returns_what_is_here(size)),
        (
            "batch_filled_in_several_gets_measures_its_rate",
            lambda: check_batch_filled_in_several_gets_measures_its_rate(size),
        ),
        (
            "acks_to_a_closed_producer_leave_with_the_stream_end",
            lambda: check_acks_to_a_closed_producer_leave_with_the_stream_end(size),
        ),
    ]
    return run_checks(checks, "ALL CHANNEL CHECKS OK", "CHANNEL_CHECKS")


if __name__ == "__main__":
    sys.exit(main())
