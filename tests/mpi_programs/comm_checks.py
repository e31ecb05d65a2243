"""Data-plane checks run on every rank under ``mpiexec -n N`` (N >= 2); asserts relative to N.

Any failure prints its traceback and aborts the whole job, so a failing check never hangs.
Run by tests/test_comm_mpi.py; by hand: ``mpiexec -n 4 python tests/mpi_programs/comm_checks.py``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections import OrderedDict, namedtuple

import numpy as np
import torch
from harness import run_checks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlinf_hpc.comm import CollectiveMismatchError, CommOptions, DataPlane, Directory
from rlinf_hpc.comm.mpi import world
from rlinf_hpc.errors import CommTimeoutError

torch.set_num_threads(1)
Point = namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor
    mask: torch.Tensor
    meta: dict


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: int
    b: torch.Tensor


def same(a: object, b: object) -> bool:
    """Deep equality that checks dtypes and shapes of tensors and arrays too."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.device.type == b.device.type
            and bool(torch.equal(a.cpu(), b.cpu()))
        )
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
        )
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(
            same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return type(a) is type(b) and a == b


ALL_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def tensor_zoo() -> dict:
    g = torch.Generator().manual_seed(0)
    zoo: dict = {}
    for dtype in ALL_DTYPES:
        base = (torch.randn(6, 8, generator=g) * 50).to(dtype)
        name = str(dtype).removeprefix("torch.")
        zoo[name] = {
            "contiguous": base,
            "transposed": base.t(),
            "strided": base[::2, 1::3],
            "zero": base[:0],
            "scalar": base[0, 0].clone().reshape(()),
            "view": base.view(-1)[5:17],
        }
    zoo["numpy"] = {
        "f": np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],
        "i": np.array([1, 2, 3], dtype=">i8"),
        "empty": np.zeros((0, 5)),
        "scalar": np.float64(2.5),
    }
    zoo["grad"] = torch.ones(3, requires_grad=True)
    zoo["mixed"] = [
        Point(1, "two"),
        (None, True, 3.5, 7 + 1j),
        b"x" * 5000,
        b"tiny",
        OrderedDict(b=1, a=2),
        Batch(torch.arange(4), torch.ones(4, dtype=torch.bool), {"id": 3}),
        Frozen(1, torch.zeros(2)),
    ]
    return zoo


def check_roundtrip_every_dtype(plane: DataPlane, peer: int) -> None:
    zoo = tensor_zoo()
    if plane.rank == 0:
        plane.send(zoo, ("workers", 0))
        back = plane.recv(("workers", 0))
        assert same(zoo, back), "zoo changed on the round trip"
        assert back["grad"].requires_grad
    elif plane.rank == peer:
        plane.send(plane.recv(0), 0)


def check_large_chunked(plane: DataPlane, peer: int) -> None:
    big = {"w": torch.randn(5_000_000), "nc": torch.randn(1000, 3000).t(), "i": torch.arange(10)}
    spans: list[tuple] = []
    plane.span_hook = lambda name, cat, lane, start, end, **args: spans.append((name, cat, args["bytes"]))
    if plane.rank == 0:
        before = plane.stats["payload_messages_sent"]
        plane.send(big, peer)
        assert spans == [("send to rank 1", "transfer", 32_000_080)], spans  # timeline span
        # 20 MB + 12 MB in chunks of at most 4 MB: 5 + 3 payload messages; the 80 B leaf
        # rides in the envelope
        assert plane.stats["payload_messages_sent"] - before == 8, plane.stats
        assert same(plane.recv(peer), big)
    elif plane.rank == peer:
        plane.send(plane.recv(0), 0)
        assert ("recv from rank 0", "transfer", 32_000_080) in spans, spans
    plane.span_hook = None


def check_order_per_tag_with_mixed_sizes(plane: DataPlane, peer: int) -> None:
    sizes = [10, 2_000_000, 5, 300_000, 1, 3_000_000, 7]
    if plane.rank == 0:
        handles = [
            plane.isend(torch.full((n,), i, dtype=torch.int32), peer, tag=i % 2) for i, n in enumerate(sizes)
        ]
        for handle in handles:
            handle.wait(30)
    elif plane.rank == peer:
        odd = [plane.recv(0, tag=1) for i in range(len(sizes)) if i % 2]
        even = [plane.recv(0, tag=0) for i in range(len(sizes)) if not i % 2]
        got = [int(t[0]) for t in even] + [int(t[0]) for t in odd]
        assert got == [0, 2, 4, 6, 1, 3, 5], got
        assert [len(t) for t in even] == sizes[::2]


def check_coalescing(plane: DataPlane, peer: int) -> None:
    count = 3000
    if plane.rank == 0:
        envelopes = plane.stats["envelopes_sent"]
        handles = [
            plane.isend({"i": i, "t": torch.full((64,), float(i))}, peer, tag="small") for i in range(count)
        ]
        for handle in handles:
            handle.wait(30)
        sent = plane.stats["envelopes_sent"] - envelopes
        assert sent <= count // 100, f"{count} small sends took {sent} MPI messages"
    elif plane.rank == peer:
        received = [plane.recv(0, tag="small") for _ in range(count)]
        assert [r["i"] for r in received] == list(range(count))
        assert all(float(r["t"][0]) == r["i"] for r in received)


def check_async_receives_complete_in_order(plane: DataPlane, peer: int) -> None:
    if plane.rank == peer:
        handles = [plane.irecv(0, tag="async") for _ in range(5)]
        world().Barrier()  # rank 0 sends only after every receive is posted
        values = [h.wait(30) for h in reversed(handles)][::-1]
        assert values == list(range(5)), values
    elif plane.rank == 0:
        world().Barrier()
        for i in range(5):
            plane.send(i, peer, tag="async")
    else:
        world().Barrier()


def check_collectives(plane: DataPlane, size: int) -> None:
    everyone = list(range(size))
    for root in range(size):
        value = plane.broadcast(
            {"root": root, "t": torch.arange(root + 3)} if plane.rank == root else None,
            root,
            everyone,
            timeout=60,
        )
        assert value["root"] == root and same(value["t"], torch.arange(root + 3))
    big = plane.broadcast(
        torch.ones(3_000_000) if plane.rank == size - 1 else None, size - 1, everyone, timeout=60
    )
    assert big.shape == (3_000_000,) and float(big.sum()) == 3_000_000
    gathered = plane.gather(torch.tensor([plane.rank]), 0, everyone, timeout=60)
    if plane.rank == 0:
        assert [int(t) for t in gathered] == everyone
    else:
        assert gathered is None
    # members given as (component, rank) addresses and as a component name
    workers = [("workers", i) for i in range(size - 1)]
    if plane.rank != 0:
        got = plane.gather(plane.rank * 10, ("workers", 0), workers, timeout=60)
        if plane.rank == 1:
            assert got == [r * 10 for r in range(1, size)]
        got = plane.broadcast("hi" if plane.rank == size - 1 else None, size - 1, "workers", timeout=60)
        assert got == "hi"
    exchanged = plane.all_to_all(
        [(plane.rank, j, torch.full((j + 1,), plane.rank)) for j in range(size)], everyone, timeout=60
    )
    assert [e[0] for e in exchanged] == everyone
    assert all(e[1] == plane.rank and e[2].tolist() == [e[0]] * (plane.rank + 1) for e in exchanged)

    # mixed objects with several large leaves per pair (the bulk path: one zero-copy MPI
    # message per leaf, every pair's posted at once) next to small ones, exact on arrival
    def mixed(src: int, dst: int) -> dict:
        return {
            "a": torch.full((70_000,), float(src * 100 + dst)),
            "b": [np.arange(50_000, dtype=np.int64) + src, b"x" * (80_000 + dst)],
            "small": torch.tensor([src, dst]),
            "meta": (src, dst, "ok"),
            "empty": torch.empty(0),
        }

    def same_mixed(got: dict, src: int, dst: int) -> bool:
        want = mixed(src, dst)
        return (
            same(got["a"], want["a"])
            and np.array_equal(got["b"][0], want["b"][0])
            and got["b"][1] == want["b"][1]
            and same(got["small"], want["small"])
            and got["meta"] == want["meta"]
            and got["empty"].shape == (0,)
        )

    exchanged = plane.all_to_all([mixed(plane.rank, j) for j in range(size)], everyone, timeout=60)
    assert all(same_mixed(got, src, plane.rank) for src, got in enumerate(exchanged))
    gathered = plane.gather(mixed(plane.rank, 0), 0, everyone, timeout=60)
    if plane.rank == 0:
        assert all(same_mixed(got, src, 0) for src, got in enumerate(gathered))
    # an ad-hoc pair
    pair = [0, size - 1]
    if plane.rank in pair:
        assert plane.broadcast(plane.rank if plane.rank == 0 else None, 0, pair, timeout=60) == 0


def tiny_zoo() -> list:
    """Single small tensors/arrays: the ones `comm.tiny` sends from a cached header, and the
    near misses that must take the general path (grad, subclasses, strides, dtypes numpy lacks)."""
    g = torch.Generator().manual_seed(1)
    zoo: list = []
    for dtype in ALL_DTYPES:
        base = (torch.randn(6, 8, generator=g) * 50).to(dtype)
        zoo += [base, base[0], base.t(), base[:0], base[0, 0].clone().reshape(())]
    zoo += [
        torch.ones(3, requires_grad=True),
        torch.nn.Parameter(torch.ones(2)),
        torch.zeros(4, dtype=torch.complex64).conj(),
        np.arange(12, dtype=np.int16).reshape(3, 4),
        np.arange(12, dtype=np.float64).reshape(3, 4, order="F"),
        np.zeros((0, 5)),
        np.array(3.5),
        np.array([1, 2], dtype=">i8"),
        np.array(["2026-12-02"], dtype="datetime64[D]"),
        np.ones(3, dtype=bool),
        torch.zeros(20_000),  # 80 KB: over the tiny limit
    ]
    return zoo


def check_tiny_messages(plane: DataPlane, peer: int) -> None:
    """Blocking sends of one small tensor/array (cached headers, `comm.tiny`) arrive exactly as
    the general path delivers them: every dtype and near miss, in order per tag among coalesced
    and large sends, into out= buffers, to receives posted earlier, safe to change once sent."""
    zoo = tiny_zoo()
    if plane.rank == 0:
        envelopes = plane.stats["envelopes_sent"]
        for obj in zoo:
            plane.send(obj, peer, tag="zoo")
        assert plane.stats["envelopes_sent"] - envelopes == len(zoo), plane.stats
        x = torch.arange(4.0)
        plane.isend({"i": 0}, peer, tag="a")  # coalesced, still queued: must leave first
        plane.send(x, peer, tag="a")
        x += 100  # sent: changing it now does not change what arrives
        plane.send(np.arange(3), peer, tag="b")
        plane.isend(torch.arange(2_000_000), peer, tag="a").wait(30)  # large, between tiny ones
        plane.send(torch.tensor([7]), peer, tag="a")
        world().Barrier()  # the peer posts an out= receive and an irecv before these leave
        plane.send(torch.full((5,), 3.0), peer, tag="out")
        plane.send(torch.tensor([9, 9]), peer, tag="posted")
    elif plane.rank == peer:
        got = [plane.recv(0, tag="zoo", timeout=30) for _ in zoo]
        for index, (sent, back) in enumerate(zip(zoo, got, strict=True)):
            assert same(sent, back), f"tiny zoo item {index} changed: {sent!r} -> {back!r}"
            assert type(back) is type(sent), (index, type(back))
            if isinstance(back, torch.Tensor):
                assert back.requires_grad == sent.requires_grad, index
            if isinstance(back, np.ndarray) and back.size:
                assert back.flags.writeable, index
        assert zoo[-1].shape == got[-1].shape
        # tag "b" first: the tag "a" envelopes ahead of it are stashed and keep their order
        assert np.array_equal(plane.recv(0, tag="b", timeout=30), np.arange(3))
        assert plane.recv(0, tag="a", timeout=30) == {"i": 0}
        assert torch.equal(plane.recv(0, tag="a", timeout=30), torch.arange(4.0))
        assert len(plane.recv(0, tag="a", timeout=30)) == 2_000_000
        assert torch.equal(plane.recv(0, tag="a", timeout=30), torch.tensor([7]))
        out = torch.zeros(5)
        handle = plane.irecv(0, tag="out", out=out)
        posted = plane.irecv(0, tag="posted")
        world().Barrier()
        assert handle.wait(30) is out and torch.equal(out, torch.full((5,), 3.0))
        assert torch.equal(posted.wait(30), torch.tensor([9, 9]))
    else:
        world().Barrier()


def check_timeout_names_both_sides(plane: DataPlane, peer: int) -> None:
    if plane.rank == 0:
        start = time.monotonic()
        try:
            plane.recv(peer, tag="never", timeout=0.3)
        except CommTimeoutError as exc:
            text = str(exc)
            assert "rank 0 (coordinator) waited for rank 1 (workers:0)" in text, text
            assert "tag 'never'" in text and "no answer after 0.3 s" in text, text
        else:
            raise AssertionError("recv did not time out")
        assert time.monotonic() - start < 2


def check_collective_errors(plane: DataPlane, peer: int) -> None:
    """A member set of its own ([peer, 0]) so that sequence numbers start at 1 here."""
    if plane.rank not in (0, peer):
        return
    pair = [peer, 0]
    if plane.rank == 0:
        plane.broadcast("from 0", 0, pair, timeout=30)  # collective #1; peer calls all_to_all
        try:  # collective #2: the peer never joins it
            plane.gather(1, 0, pair, timeout=0.3)
        except CommTimeoutError as exc:
            assert "in gather #2 over ranks [1, 0] (root 0)" in str(exc), str(exc)
            assert "did rank 1 (workers:0) call gather with the same members?" in str(exc)
        else:
            raise AssertionError("gather without the peer did not time out")
        # the peer's all_to_all message for #1 is still here: drain it
        assert plane.recv(peer, ("coll", (1, 0), 1), timeout=30)[0] == "all_to_all"
    else:
        try:
            plane.all_to_all(["x", "y"], pair, timeout=30)
        except CollectiveMismatchError as exc:
            text = str(exc)
            assert "rank 1 (workers:0) called all_to_all (root -1) as collective #1" in text, text
            assert "rank 0 (coordinator) called broadcast (root 0)" in text, text
        else:
            raise AssertionError("mismatched collectives were not detected")


def check_bulk_timeout(plane: DataPlane, peer: int) -> None:
    """A gather member whose root took its description in (while waiting on something else)
    but did not join times out naming the bulk bytes; its message still arrives intact when
    the root joins later."""
    if plane.rank not in (0, peer):
        return
    members = [0, peer]
    if plane.rank == peer:
        assert plane.recv(0, tag="bulk-ready", timeout=30) == "ready"
        start = time.monotonic()
        try:
            plane.gather(torch.full((300_000,), 7.0), 0, members, timeout=2.0)
        except CommTimeoutError as exc:
            assert "the bulk bytes to or from ranks [0] did not move within 2.0 s" in str(exc), str(exc)
        else:
            raise AssertionError("gather whose root never joined did not time out")
        assert time.monotonic() - start < 6
        plane.send("joined now", 0, tag="bulk-go", timeout=30)
    else:
        plane.send("ready", peer, tag="bulk-ready", timeout=30)
        assert plane.recv(peer, tag="bulk-go", timeout=30) == "joined now"  # pulls the description
        got = plane.gather(None, 0, members, timeout=30)
        assert got[0] is None and float(got[1].sum()) == 7.0 * 300_000, got


def check_root_joins_after_member_gave_up(plane: DataPlane, peer: int) -> None:
    """A gather member gives up before the root took its description in (the bulk bytes wait
    for that); the root, joining later, still gets the whole object, and the member's timeout
    names the root and the full time it waited."""
    if plane.rank not in (0, peer):
        return
    members = [0, peer]
    if plane.rank == peer:
        start = time.monotonic()
        try:
            plane.gather(torch.full((300_000,), 3.0), 0, members, timeout=1.0)
        except CommTimeoutError as exc:
            assert "no answer after 1.0 s; did rank 0 (coordinator) call gather" in str(exc), str(exc)
        else:
            raise AssertionError("gather whose root never joined did not time out")
        assert time.monotonic() - start < 5
        plane.send("gave up", 0, tag="late-go", timeout=30)
        assert plane.recv(0, tag="late-done", timeout=60) == "done"  # keep the bytes mapped
    else:
        time.sleep(2.0)  # not polling the data plane: the description stays with the sender
        assert plane.recv(peer, tag="late-go", timeout=30) == "gave up"
        got = plane.gather(None, 0, members, timeout=30)
        assert got[0] is None and float(got[1].sum()) == 3.0 * 300_000, got
        plane.send("done", peer, tag="late-done", timeout=30)


def check_receive_into_out_buffers(plane: DataPlane, peer: int) -> None:
    message = {"step": 7, "w": torch.arange(1_000_000, dtype=torch.float32), "b": torch.arange(5)}
    if plane.rank == peer:
        out = {"step": 0, "w": torch.empty(1_000_000), "b": torch.empty(5, dtype=torch.int64)}
        in_place = plane.pending()["received_in_place"]
        handle = plane.irecv(0, tag="out", out=out)
        world().Barrier()  # posted before the message leaves: bytes land in out directly
        got = handle.wait(30)
        assert plane.pending()["received_in_place"] == in_place + 1
        assert got["step"] == 7 and got["w"] is out["w"] and got["b"] is out["b"]
        assert torch.equal(got["b"], torch.arange(5))
        world().Barrier()
        # receiving the marker takes in the envelope sent before it: the second message is
        # stashed in fresh memory before its receive is posted, so it is copied into out
        assert plane.recv(0, tag="marker", timeout=30) == "marker"
        late = plane.recv(0, tag="out", out=out, timeout=30)
        assert plane.pending()["received_in_place"] == in_place + 1  # this one was copied
        assert late["w"] is out["w"] and float(late["w"][0]) == float(message["w"][0]) + 1
    elif plane.rank == 0:
        world().Barrier()
        plane.send(message, peer, tag="out")
        world().Barrier()
        message["w"] += 1
        plane.send(message, peer, tag="out")
        plane.send("marker", peer, tag="marker")
    else:
        world().Barrier()
        world().Barrier()


def check_links(size: int, peer: int) -> None:
    """gloo links on CPU: created lazily, cached, directional, released when the directory
    changes, re-created afterwards; and a link that cannot be set up falls back to MPI."""
    directory = Directory(groups={"workers": list(range(1, size))}, world_size=size)
    plane = DataPlane(directory, options=CommOptions(cpu_link="gloo", link_timeout_s=20))
    message = {"w": torch.arange(1_000_000, dtype=torch.float32), "small": torch.tensor([3])}
    if plane.rank == 0:
        for _ in range(2):
            plane.send(message, peer, tag="link", timeout=60)
        assert plane.pending()["links_created"] == 1, plane.pending()  # created once, reused
        back = plane.recv(peer, tag="link-back", timeout=60)  # peer -> 0 is a link of its own
        assert same(back, message)
        assert plane.pending()["links_live"] == 2, plane.pending()
    elif plane.rank == peer:
        for _ in range(2):
            assert same(plane.recv(0, tag="link", timeout=60), message)
        plane.send(message, 0, tag="link-back", timeout=60)
        assert plane.pending()["links_live"] == 2 and plane.pending()["links_created"] == 1
    world().Barrier()
    # the peer changes place in the job: every rank drops its links to and from it
    moved = {"workers": list(range(1, size)), "actor": [peer]}  # the peer joins another group
    plane.set_directory(Directory(groups=moved, world_size=size))
    if plane.rank in (0, peer):
        assert plane.pending()["links_live"] == 0, plane.pending()
    if plane.rank == 0:
        plane.send(message, peer, tag="again", timeout=60)
        assert plane.pending()["links_created"] == 2
    elif plane.rank == peer:
        assert same(plane.recv(0, tag="again", timeout=60), message)
    world().Barrier()
    # a link whose store address is wrong: both sides fail the rendezvous, bytes go over MPI
    broken = DataPlane(directory, options=CommOptions(cpu_link="gloo", link_timeout_s=3))
    if broken.rank == 0:
        broken.links.fault_bad_address = True
        start = time.monotonic()
        broken.send(message, peer, tag="fallback", timeout=60)
        broken.send(message, peer, tag="fallback", timeout=60)  # no second attempt: host at once
        assert broken.pending()["links_created"] == 0 and broken.links._broken == {(peer, "gloo")}
        assert time.monotonic() - start < 30
    elif broken.rank == peer:
        for _ in range(2):
            assert same(broken.recv(0, tag="fallback", timeout=60), message)
        assert broken.pending()["links_live"] == 0
    world().Barrier()


def check_link_fails_during_transfer(size: int, peer: int) -> None:
    """A link that breaks during a transfer (either side): the message arrives intact over the
    MPI host path, as do the messages behind it in flight on the same link, and the pair's
    later messages take the host path; nothing raises."""
    directory = Directory(groups={"workers": list(range(1, size))}, world_size=size)
    for side in ("send", "recv"):
        plane = DataPlane(directory, options=CommOptions(cpu_link="gloo", link_timeout_s=5))
        messages = [{"w": torch.arange(300_000, dtype=torch.float32) + k, "k": k} for k in range(5)]
        if plane.rank == 0:
            plane.send(messages[0], peer, tag="lf", timeout=60)  # the link is up and carries it
            world().Barrier()
            if side == "send":
                plane.links.fault_fail_sends = 1
            handles = [plane.isend(m, peer, tag="lf") for m in messages[1:4]]  # in flight together
            for handle in handles:
                handle.wait(60)
            plane.send(messages[4], peer, tag="lf", timeout=60)  # after the failure: host path
            stats = plane.pending()
            assert stats["links_live"] == 0 and plane.links._broken == {(peer, "gloo")}, stats
            assert stats["link_resends"] >= 1, stats
            assert stats["links_created"] == 1, stats  # no second link for this pair
        elif plane.rank == peer:
            assert same(plane.recv(0, tag="lf", timeout=60), messages[0])
            world().Barrier()
            if side == "recv":
                plane.links.fault_fail_recvs = 1
            started = time.monotonic()
            for message in messages[1:]:
                got = plane.recv(0, tag="lf", timeout=60)
                assert same(got, message), (side, message["k"], got["k"])
            assert time.monotonic() - started < 30, time.monotonic() - started
            assert plane.pending()["links_live"] == 0, plane.pending()
        else:
            world().Barrier()
        world().Barrier()


def check_bad_input(plane: DataPlane, peer: int, size: int) -> None:
    try:
        plane.isend({"batch": [0, 1, 2, Batch(torch.ones(1), {1, 2}, {})]}, peer)
    except TypeError as exc:
        assert "obj['batch'][3].mask" in str(exc) and "set" in str(exc), str(exc)
    else:
        raise AssertionError("a set leaf was accepted")
    for bad in (size, ("workers", size), ("nobody", 0)):
        try:
            plane.isend(1, bad)
        except ValueError as exc:
            assert "does not exist" in str(exc) or "no component" in str(exc), str(exc)
        else:
            raise AssertionError(f"sending to {bad} was accepted")
    if plane.rank == 0:
        plane.send(torch.zeros(4, 4), peer, tag="shape")
        plane.send(torch.zeros(3), peer, tag="shape")
    elif plane.rank == peer:
        try:
            plane.recv(0, tag="shape", out=torch.empty(2, 2, dtype=torch.int64))
        except ValueError as exc:
            text = str(exc)
            assert "rank 0 (coordinator) sent a message (tag 'shape') that does not fit" in text
            assert "tensor float32 (4, 4), out= has tensor int64 (2, 2)" in text, text
        else:
            raise AssertionError("wrong-shaped out= buffer was accepted")
        out = torch.empty(3)
        assert plane.recv(0, tag="shape", out=out) is out


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=2000),
)


def strided_tensor(shape: tuple[int, ...], dtype: torch.dtype, step: int) -> torch.Tensor:
    """A view with stride ``step`` in its last dimension (non-contiguous when step > 1)."""
    full = (torch.arange(int(np.prod(shape)) * step) % 7).to(dtype)
    return full.reshape(*shape, step)[..., 0]


tensors = st.builds(
    strided_tensor,
    st.lists(st.integers(0, 4), max_size=3).map(tuple),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16]),
    st.integers(1, 3),
)
arrays = st.builds(
    lambda n, dt: np.arange(n).astype(dt), st.integers(0, 20), st.sampled_from(["f4", "i2", "u1", "f8", "?"])
)
trees = st.recursive(
    st.one_of(scalars, tensors, arrays),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.tuples(children, children),
        st.dictionaries(st.text(max_size=5), children, max_size=4),
        st.builds(Point, children, children),
    ),
    max_leaves=12,
)


def check_hypothesis_ring(plane: DataPlane, size: int) -> None:
    """Rank 0 sends generated objects around the ring of all ranks and compares."""
    stop = "__stop__"
    if plane.rank != 0:
        while True:
            obj = plane.recv(plane.rank - 1, tag="ring")
            plane.send(obj, (plane.rank + 1) % size, tag="ring")
            if isinstance(obj, str) and obj == stop:
                return

    @settings(
        max_examples=int(os.environ.get("RING_EXAMPLES", "60")),
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        derandomize=True,
    )
    @given(trees)
    def ring(obj: object) -> None:
        plane.send(obj, 1, tag="ring")
        back = plane.recv(size - 1, tag="ring", timeout=60)
        assert same(obj, back), (obj, back)

    ring()
    plane.send(stop, 1, tag="ring")
    plane.recv(size - 1, tag="ring", timeout=60)


def main() -> int:
    comm = world()
    size = comm.Get_size()
    assert size >= 2, "run under mpiexec -n 2 or more"
    plane = DataPlane(
        Directory(groups={"workers": list(range(1, size))}, world_size=size),
        options=CommOptions(chunk_bytes=4 << 20),
    )
    peer = 1
    checks = [
        ("roundtrip_every_dtype", lambda: check_roundtrip_every_dtype(plane, peer)),
        ("large_chunked", lambda: check_large_chunked(plane, peer)),
        ("order_per_tag", lambda: check_order_per_tag_with_mixed_sizes(plane, peer)),
        ("coalescing", lambda: check_coalescing(plane, peer)),
        ("tiny_messages", lambda: check_tiny_messages(plane, peer)),
        ("async_receives", lambda: check_async_receives_complete_in_order(plane, peer)),
        ("collectives", lambda: check_collectives(plane, size)),
        ("timeout", lambda: check_timeout_names_both_sides(plane, peer)),
        ("collective_errors", lambda: check_collective_errors(plane, peer)),
        ("bulk_timeout", lambda: check_bulk_timeout(plane, peer)),
        ("root_joins_after_member_gave_up", lambda: check_root_joins_after_member_gave_up(plane, peer)),
        ("receive_into_out", lambda: check_receive_into_out_buffers(plane, peer)),
        ("bad_input", lambda: check_bad_input(plane, peer, size)),
        ("hypothesis_ring", lambda: check_hypothesis_ring(plane, size)),
        ("links", lambda: check_links(size, peer)),
        ("link_fails", lambda: check_link_fails_during_transfer(size, peer)),
    ]
    return run_checks(checks, "ALL CHECKS OK", "COMM_CHECKS")


if __name__ == "__main__":
    sys.exit(main())
