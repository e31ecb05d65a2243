"""Packing in one process: descriptions stay compact, bad leaves name their path."""

from __future__ import annotations

import dataclasses
import pickle
from collections import defaultdict, namedtuple

import numpy as np
import pytest
import torch

from rlinf_hpc.comm.buffers import allocate_leaf
from rlinf_hpc.comm.packing import leaf_nodes, pack, unpack

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


@dataclasses.dataclass
class WithDerived:
    values: list

    def __post_init__(self) -> None:
        self.total = sum(self.values)  # not a field: must still arrive


@dataclasses.dataclass(slots=True)
class Slotted:
    a: int
    b: torch.Tensor


def test_odd_objects_arrive_exactly() -> None:
    masked = np.ma.MaskedArray([1.0, 2.0, 3.0], mask=[False, True, False], fill_value=-9.0)
    record = np.zeros(2, dtype=[("x", "<i4"), ("y", "<f8")])
    record[1] = (7, 2.5)
    parameter = torch.nn.Parameter(torch.ones(3))
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    out = roundtrip(
        {
            "masked": masked,
            "element": record[1],
            "param": parameter,
            "frozen": frozen,
            "derived": WithDerived([1, 2, 3]),
            "slotted": Slotted(1, torch.zeros(2)),
            "memmap_like": np.arange(4).view(np.ndarray),
        }
    )
    assert isinstance(out["masked"], np.ma.MaskedArray)
    assert out["masked"].mask.tolist() == [False, True, False] and out["masked"].fill_value == -9.0
    assert np.array_equal(out["masked"].data, masked.data)
    element = out["element"]
    assert isinstance(element, np.void) and element.dtype == record.dtype
    assert element["x"] == 7 and element["y"] == 2.5
    assert type(out["param"]) is torch.nn.Parameter and out["param"].requires_grad
    assert type(out["frozen"]) is torch.nn.Parameter and not out["frozen"].requires_grad
    assert out["derived"].values == [1, 2, 3] and out["derived"].total == 6
    assert out["slotted"].a == 1 and torch.equal(out["slotted"].b, torch.zeros(2))


def test_the_same_tensor_twice_travels_once_and_arrives_as_one_object() -> None:
    shared = torch.arange(1000.0)
    description, leaves = pack({"a": shared, "b": [shared, shared], "c": torch.arange(3)})
    assert len(leaves) == 2 and sum(leaf.nbytes for leaf in leaves) == 4000 + 24
    out = roundtrip({"a": shared, "b": [shared, shared]})
    assert out["a"] is out["b"][0] is out["b"][1] and torch.equal(out["a"], shared)
    view = shared[:10]  # a different tensor on the same storage: its own copy (documented)
    assert len(pack([shared, view])[1]) == 2


def test_objects_the_receiver_could_not_rebuild_are_refused_at_the_sender() -> None:
    Local = namedtuple("Local", ["x"])  # noqa: PYI024 - defined inside a function on purpose
    cyclic: list = [1]
    cyclic.append({"back": cyclic})
    cases = [
        ({"p": Local(1)}, TypeError, "obj['p']: namedtuple Local cannot be rebuilt"),
        ({"d": defaultdict(list)}, TypeError, "send dict(x)"),
        (np.arange(4).view(np.recarray), TypeError, "send np.asarray(x)"),
        ({"c": cyclic}, ValueError, "obj['c'][1]['back']: refers back to obj['c']"),
    ]
    for obj, error, text in cases:
        with pytest.raises(error) as caught:
            pack(obj)
        assert text in str(caught.value), str(caught.value)
