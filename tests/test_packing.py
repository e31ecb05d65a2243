"""Packing in one process: descriptions stay compact, bad leaves name their path."""

from __future__ import annotations

import pickle
from collections import namedtuple

import numpy as np
import pytest
import torch

from rlinf_hpc.comm.packing import allocate_leaf, leaf_nodes, pack, unpack

Pair = namedtuple("Pair", ["left", "right"])


def roundtrip(obj: object) -> object:
    description, leaves = pack(obj)
    targets = [allocate_leaf(node) for node in leaf_nodes(pickle.loads(pickle.dumps(description)))]
    for (_, view), leaf in zip(targets, leaves, strict=True):
        view[:] = leaf.host_bytes()
    return unpack(description, [value for value, _ in targets])


def test_description_is_compact_and_payload_is_not_pickled() -> None:
    obj = {f"t{i}": torch.randn(1_500_000) for i in range(10)}  # 60 MB of payload
    description, leaves = pack(obj)
    assert len(pickle.dumps(description)) < 1000
    assert sum(leaf.nbytes for leaf in leaves) == 60_000_000


def test_tensor_views_share_memory_until_staged() -> None:
    tensor = torch.arange(10, dtype=torch.float32)
    _, leaves = pack(tensor)
    view = leaves[0].host_bytes()
    tensor[0] = 42.0  # contiguous CPU tensors are sent from their own memory: no copy
    assert np.frombuffer(view, dtype=np.float32)[0] == 42.0


def test_roundtrip_keeps_types_dtypes_and_values() -> None:
    obj = Pair([torch.ones(2, 3).t(), np.int16(7)], {"b": b"z" * 3000, "s": "x", "n": None})
    out = roundtrip(obj)
    assert isinstance(out, Pair)
    assert torch.equal(out.left[0], torch.ones(3, 2)) and out.left[1] == np.int16(7)
    assert out.right == {"b": b"z" * 3000, "s": "x", "n": None}


@pytest.mark.parametrize(
    ("obj", "path"),
    [
        ({"batch": [1, 2, 3, {"mask": {1}}]}, "obj['batch'][3]['mask']"),
        ([object()], "obj[0]"),
        (Pair(1, lambda: 0), "obj.right"),
        ({"a": np.array([object()])}, "obj['a']"),
        ({"s": torch.eye(2).to_sparse()}, "obj['s']"),
    ],
)
def test_unsupported_leaf_names_its_path(obj: object, path: str) -> None:
    with pytest.raises(TypeError) as err:
        pack(obj)
    assert str(err.value).startswith(path + ":"), str(err.value)
