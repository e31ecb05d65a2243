"""Data-plane failure-path checks under ``mpiexec -n N`` (N >= 2; fan-in uses every rank).

Each check is a behaviour a long job relies on: no torn message when handles are dropped or a
send gives up, a bad message fails alone, head-to-head sends complete, a timed-out receive does
not eat the next message, allocating receives do not leak, integrity mode names the sender.
Run by tests/test_comm_hardening_mpi.py; by hand:
``mpiexec -n 4 python tests/mpi_programs/hardening_checks.py``.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import psutil
import torch
from harness import run_checks

from rlinf_hpc.channel import Channel
from rlinf_hpc.comm import ChannelSpec, CommOptions, DataPlane, Directory, wire
from rlinf_hpc.comm.collectives import tree_children
from rlinf_hpc.comm.mpi import world
from rlinf_hpc.errors import CommTimeoutError
from rlinf_hpc.workers.weights import receive_weights, send_weights, take_weights

torch.set_num_threads(1)
MB = 1 << 20


def pattern(seed: int, nbytes: int) -> np.ndarray:
    return (np.arange(nbytes, dtype=np.uint32) * 2654435761 + seed).astype(np.uint8)


def churn(nbytes: int) -> None:
    """Reuse freed memory with other bytes, as a busy rank would (so that a buffer released
    while MPI still reads it would go out with garbage in it)."""
    junk = [bytearray(b"\xa5") * nbytes for _ in range(4)]
    del junk
    gc.collect()


def check_dropped_handles_fan_in(plane: DataPlane, size: int) -> None:
    """Every rank fires small sends at rank 0 and drops the handles (as channel acks and END
    markers do); rank 0 starts late, so MPI still owns the batches when Python lets go."""
    count, nbytes = 40, 24 << 10
    if plane.rank != 0:
        for i in range(count):
            plane.isend({"i": i, "data": pattern(plane.rank * 1000 + i, nbytes)}, 0, tag="fan")
            if i % 8 == 7:
                plane.flush()
                churn(nbytes * 8)
        plane.flush()
        churn(4 * MB)
        time.sleep(0.5)
        churn(4 * MB)
        plane.progress()
        return
    time.sleep(1.0)
    for source in range(1, size):
        for i in range(count):
            message = plane.recv(source, tag="fan", timeout=60)
            assert message["i"] == i, (source, i, message["i"])
            assert np.array_equal(message["data"], pattern(source * 1000 + i, nbytes)), (source, i)


def check_send_timeout_keeps_buffers(plane: DataPlane, peer: int) -> None:
    """A send that times out is delivered intact later: the plane keeps what MPI reads."""
    sizes = [32 << 10, 256 << 10, 16 * MB]  # inline envelope, large (single chunk), chunked
    if plane.rank == 0:
        for index, nbytes in enumerate(sizes):
            tensor = torch.from_numpy(pattern(index, nbytes).copy())
            try:
                plane.send(tensor, peer, tag="late", timeout=0.2)
            except CommTimeoutError:
                pass
            else:  # MPI may take a small message eagerly; the large ones must wait
                assert nbytes < MB, f"send of {nbytes} bytes did not time out"
            del tensor
            churn(nbytes)
    # Not a receive from rank 0: any receive takes in every envelope rank 0 sent.
    world().Barrier()
    if plane.rank == peer:
        for index, nbytes in enumerate(sizes):
            got = plane.recv(0, tag="late", timeout=60)
            assert torch.equal(got, torch.from_numpy(pattern(index, nbytes))), f"torn {nbytes}-byte message"


def check_recv_timeout_withdraws(plane: DataPlane, peer: int) -> None:
    """A receive that timed out does not take the next message from its sender."""
    if plane.rank == peer:
        try:
            plane.recv(0, tag="next", timeout=0.2)
        except CommTimeoutError:
            pass
        else:
            raise AssertionError("recv did not time out")
        handle = plane.irecv(0, tag="next")
        with contextlib.suppress(CommTimeoutError):
            handle.wait(0.1)
        plane.send("ready", 0, tag="next-ready")
        assert plane.recv(0, tag="next", timeout=30) == "first"
        assert plane.recv(0, tag="next", timeout=30) == "second"
        try:
            handle.wait(0.1)
        except CommTimeoutError as error:
            assert "withdrawn" in str(error), error
        else:
            raise AssertionError("a withdrawn receive completed")
    elif plane.rank == 0:
        plane.recv(peer, tag="next-ready", timeout=30)
        plane.send("first", peer, tag="next")
        plane.send("second", peer, tag="next")


def check_bad_message_fails_alone(plane: DataPlane, peer: int) -> None:
    """An unencodable small message raises at isend, naming the path; the others arrive."""
    if plane.rank == 0:
        handles = [plane.isend({"n": 1}, peer, tag="bad")]
        try:
            plane.isend({"ok": 1, "nested": {threading.Lock(): 2}}, peer, tag="bad")
        except TypeError as error:
            assert "obj['nested'] key <unlocked _thread.lock" in str(error), error
        else:
            raise AssertionError("an unpicklable dict key was accepted")
        try:
            plane.send(torch.zeros(1 << 18), peer, tag=threading.Lock())
        except TypeError as error:
            assert "tag" in str(error), error
        else:
            raise AssertionError("an unpicklable tag was accepted")
        handles.append(plane.isend({"n": 2}, peer, tag="bad"))
        for handle in handles:
            handle.wait(30)
    elif plane.rank == peer:
        assert plane.recv(0, tag="bad", timeout=30) == {"n": 1}
        assert plane.recv(0, tag="bad", timeout=30) == {"n": 2}


def check_head_to_head_sends(plane: DataPlane, peer: int) -> None:
    """Two ranks that send() to each other at once both complete, at every size."""
    if plane.rank not in (0, peer):
        return
    other = peer if plane.rank == 0 else 0
    for nbytes in [8 << 10, 64 << 10, 1 * MB, 32 * MB]:
        mine = torch.from_numpy(pattern(plane.rank, nbytes).copy())
        plane.send(mine, other, tag=("h2h", nbytes), timeout=30)
        theirs = plane.recv(other, tag=("h2h", nbytes), timeout=30)
        assert torch.equal(theirs, torch.from_numpy(pattern(other, nbytes))), nbytes


def rss() -> int:
    return psutil.Process().memory_info().rss


def assert_rss_flat(receive: Callable[[], object], count: int, limit: int, what: str) -> None:
    """``receive`` twice to warm up (allocator and MPI buffers settle), then ``count`` times:
    RSS must grow by less than ``limit`` bytes (the received objects are dropped each time)."""
    receive()
    receive()
    before = rss()
    for _ in range(count):
        receive()
    growth = rss() - before
    assert growth < limit, f"RSS grew {growth / MB:.0f} MB over {count} {what}"


def check_allocating_recv_does_not_leak(plane: DataPlane, peer: int) -> None:
    """With the cycle collector off, 100 allocating receives of 64 MB keep RSS flat (within one
    message), directly and through a channel."""
    count, nbytes = 100, 64 * MB
    if plane.rank not in (0, peer):
        return
    gc.disable()
    try:
        if plane.rank == 0:
            payload = torch.ones(nbytes // 4)
            for _ in range(count + 2):
                plane.send(payload, peer, tag="leak", timeout=60)
            return

        def receive() -> None:
            assert plane.recv(0, tag="leak", timeout=60).numel() == nbytes // 4

        assert_rss_flat(receive, count, int(1.5 * nbytes), "receives")
    finally:
        gc.enable()


def check_channel_gets_do_not_leak(size: int) -> None:
    """The channel path (put/get of 16 MB items, acks dropped) keeps RSS flat without gc."""
    count, nbytes = 40, 16 * MB
    spec = ChannelSpec("leaky", (0,), (1,), capacity=2)
    directory = Directory(groups={"workers": list(range(1, size))}, world_size=size, channels={"leaky": spec})
    plane = DataPlane(directory)
    channel = Channel(plane, "leaky")
    gc.disable()
    try:
        if plane.rank == 0:
            for _ in range(count + 2):
                channel.put(torch.ones(nbytes // 4), timeout=60)
            channel.close()
        elif plane.rank == 1:
            assert_rss_flat(lambda: channel.get(timeout=60), count, 3 * nbytes, "channel gets")
    finally:
        gc.enable()


def check_integrity_mode_names_sender(size: int) -> None:
    """Integrity mode: a flipped byte in an envelope or a payload is reported, naming the
    sender, the tag and the size; clean messages of every path pass."""
    plane = DataPlane(Directory(world_size=size), options=CommOptions(verify=True))
    if plane.rank == 0:
        for obj in ["small", torch.arange(20_000), torch.arange(1 << 20)]:  # batch, inline, large
            plane.send(obj, 1, tag="clean")
        envelope = wire.encode(("S", "torn", ("l", [1]), True, 0), [], checksum=True)
        envelope[-1] ^= 0xFF
        plane._comm.Send(envelope, 1, 21)  # noqa: SLF001 - forge a torn message
        payload = np.arange(1 << 18, dtype=np.int32)
        header = (
            "S",
            "torn-payload",
            ("A", 0, payload.dtype.str, payload.shape),
            False,
            1 << 30,
            ["host"],
            [],
            [wire.checksum(memoryview(payload).cast("B"))],
        )
        plane._comm.Send(wire.encode(header, [], checksum=True), 1, 21)  # noqa: SLF001
        torn = payload.copy()
        torn[7] += 1
        plane._comm.Send(torn, 1, 22)  # noqa: SLF001
    elif plane.rank == 1:
        assert plane.recv(0, tag="clean", timeout=30) == "small"
        assert torch.equal(plane.recv(0, tag="clean", timeout=30), torch.arange(20_000))
        assert torch.equal(plane.recv(0, tag="clean", timeout=30), torch.arange(1 << 20))
        for tag, expected in [("torn", "envelope of"), ("torn-payload", "payload leaf 0")]:
            try:
                plane.recv(0, tag=tag, timeout=30)
            except wire.CorruptMessageError as error:
                text = str(error)
                assert "rank 0" in text and expected in text and "checksum" in text, text
                if tag == "torn-payload":
                    assert "'torn-payload'" in text and "1048576 bytes" in text, text
            else:
                raise AssertionError(f"a corrupted message ({tag}) was accepted")


class _Normalized(torch.nn.Sequential):
    """Two layers, a persistent float64 buffer (running statistics: synced) and a
    non-persistent one (a table every rank builds itself: not synced)."""

    def __init__(self) -> None:
        super().__init__(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
        self.register_buffer("stats", torch.zeros(256, dtype=torch.float64))
        self.register_buffer("table", torch.zeros(4), persistent=False)


def check_weight_sync_is_a_tree(plane: DataPlane, size: int) -> None:
    """The actor (rank 0) sends ceil(log2(N + 1)) copies, not N; every target ends with its
    weights and persistent buffers exactly, in place (allocating and in-place receivers mixed),
    and its non-persistent buffers untouched."""
    torch.manual_seed(0)
    model = _Normalized()
    model.stats.normal_()
    model.table.fill_(7.0)
    nbytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), model.stats])
    targets = [(rank, ("weights", rank)) for rank in range(1, size)]
    if plane.rank == 0:
        before = plane.stats["bytes_sent"]
        send_weights(plane, model, targets)
        copies = len(tree_children(0, size))
        sent = plane.stats["bytes_sent"] - before
        assert copies * nbytes <= sent < (copies + 1) * nbytes, (sent, copies, nbytes)
        return
    mine = _Normalized()
    if plane.rank % 2:
        receive_weights(plane, mine, 0, ("weights", plane.rank))
    else:
        mine.load_state_dict(take_weights(plane, 0, ("weights", plane.rank)), strict=False)
    torch.manual_seed(0)
    reference = _Normalized()
    reference.stats.normal_()
    for got, want in zip(mine.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got, want), "weights differ after sync"
    assert torch.equal(mine.stats, reference.stats), "a persistent buffer was not synced"
    assert torch.equal(mine.table, torch.zeros(4)), "a non-persistent buffer was overwritten"


def main() -> int:
    comm = world()
    size = comm.Get_size()
    assert size >= 2, "run under mpiexec -n 2 or more"
    plane = DataPlane(Directory(groups={"workers": list(range(1, size))}, world_size=size))
    peer = 1
    checks = [
        ("dropped_handles_fan_in", lambda: check_dropped_handles_fan_in(plane, size)),
        ("send_timeout_keeps_buffers", lambda: check_send_timeout_keeps_buffers(plane, peer)),
        ("recv_timeout_withdraws", lambda: check_recv_timeout_withdraws(plane, peer)),
        ("bad_message_fails_alone", lambda: check_bad_message_fails_alone(plane, peer)),
        ("head_to_head_sends", lambda: check_head_to_head_sends(plane, peer)),
        ("allocating_recv_no_leak", lambda: check_allocating_recv_does_not_leak(plane, peer)),
        ("channel_gets_no_leak", lambda: check_channel_gets_do_not_leak(size)),
        ("integrity_mode", lambda: check_integrity_mode_names_sender(size)),
        ("weight_sync_is_a_tree", lambda: check_weight_sync_is_a_tree(plane, size)),
    ]
    return run_checks(checks, "ALL CHECKS OK", "HARDENING_CHECKS")


if __name__ == "__main__":
    sys.exit(main())
