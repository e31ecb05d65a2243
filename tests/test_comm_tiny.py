"""`comm.tiny`: cached envelopes are byte for byte what the general path writes, and the
receiver's cache only serves headers whose leaf is the whole object."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlinf_hpc.comm import tiny, wire
from rlinf_hpc.comm.packing import pack


def general_envelope(obj: object, tag: object, checksum: bool = False) -> bytes:
    description, leaves = pack(obj)
    return bytes(
        wire.encode(("S", tag, description, True, 0), [leaf.host_bytes() for leaf in leaves], checksum)
    )


@pytest.mark.parametrize(
    "obj",
    [
        torch.arange(6, dtype=torch.int16).reshape(2, 3),
        torch.randn(256),
        torch.zeros(0, 4),
        torch.tensor(2.5, dtype=torch.float64),
        torch.ones(3, dtype=torch.bool),
        np.arange(5, dtype=">i4"),
        np.zeros((2, 0)),
        np.array(1 + 2j),
    ],
)
@pytest.mark.parametrize("tag", [0, "step", ("role", 3)])
def test_cached_envelopes_equal_the_general_path(obj: object, tag: object) -> None:
    encoder = tiny.TinyEncoder(limit=64 << 10)
    first, second = encoder.envelope(obj, tag), encoder.envelope(obj, tag)  # built, then cached
    assert first == second == general_envelope(obj, tag)
    decoder = tiny.TinyDecoder()
    for _ in range(2):  # decoded, then from the cache
        header, tail, is_tiny = decoder.decode(bytearray(first))
        assert is_tiny and header == wire.decode(bytearray(first))[0] and header[1] == tag
        assert bytes(tail) == b"".join(bytes(leaf.host_bytes()) for leaf in pack(obj)[1])


@pytest.mark.parametrize(
    "obj",
    [
        torch.ones(3, requires_grad=True),
        torch.nn.Parameter(torch.ones(2)),
        torch.ones(4, 4).t(),
        torch.ones(2, dtype=torch.bfloat16),
        np.ones((3, 3), order="F"),
        np.array(["2026-12-02"], dtype="datetime64[D]"),
        np.zeros(1, dtype=[("a", "i4")]),
        torch.zeros(20_000),  # 80 KB: over the limit
        {"x": torch.ones(1)},
        [1, 2],
    ],
)
def test_what_does_not_qualify_takes_the_general_path(obj: object) -> None:
    assert tiny.TinyEncoder(limit=64 << 10).envelope(obj, 0) is None


def test_a_tag_pickle_refuses_leaves_the_error_to_the_general_path() -> None:
    import threading

    lock = threading.Lock()  # hashable, not picklable
    assert tiny.TinyEncoder(limit=1024).envelope(torch.ones(2), lock) is None


def test_the_receiver_caches_only_plain_leaves() -> None:
    decoder = tiny.TinyDecoder()
    for obj in (torch.ones(3, requires_grad=True), torch.nn.Parameter(torch.ones(2)), {"x": 1}, 7):
        envelope = bytearray(general_envelope(obj, 0))
        header, _, is_tiny = decoder.decode(envelope)
        assert not is_tiny and header == wire.decode(envelope)[0]
    assert not decoder._known
    # integrity mode: checksummed envelopes are always decoded (and checked) the general way
    envelope = bytearray(general_envelope(torch.ones(2), 0, checksum=True))
    assert decoder.decode(envelope)[2] is False and not decoder._known
    envelope[-1] ^= 0xFF  # a torn payload byte: the checksum catches it
    with pytest.raises(wire.CorruptMessageError, match="checksum"):
        decoder.decode(envelope)


def test_caches_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiny, "_CACHE_MAX", 4)
    encoder, decoder = tiny.TinyEncoder(limit=1024), tiny.TinyDecoder()
    for tag in range(10):
        decoder.decode(bytearray(encoder.envelope(torch.ones(2), tag)))
    assert len(encoder._heads) <= 4 and len(decoder._known) <= 4
