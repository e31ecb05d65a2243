"""Structure-aware packing: split an object into a compact description and raw buffers.

Tensors, numpy arrays and large ``bytes`` become *leaves* whose bytes travel as raw buffers
(never pickled); everything else — the nesting of dicts, lists, tuples, dataclasses and
namedtuples, scalars, strings, shapes and dtypes — goes into a small description tuple that is
pickled. `unpack` rebuilds the object from the description and the received buffers.

The receiver allocates each leaf (`buffers.allocate_leaf`), fills its byte view, then unpacks:

>>> import numpy as np
>>> from rlinf_hpc.comm.buffers import allocate_leaf
>>> description, leaves = pack({"x": np.arange(3, dtype=np.int16), "n": [1, "a", None]})
>>> [leaf.nbytes for leaf in leaves]
[6]
>>> targets = [allocate_leaf(node) for node in leaf_nodes(description)]
>>> for (_, view), leaf in zip(targets, leaves):
...     view[:] = leaf.host_bytes()
>>> unpack(description, [value for value, _ in targets])
{'x': array([0, 1, 2], dtype=int16), 'n': [1, 'a', None]}
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import pickle
from collections import OrderedDict
from typing import Any

import numpy as np

from rlinf_hpc.imports import loaded

#: ``bytes`` objects at least this long travel as raw buffers; shorter ones ride in the description.
BYTES_LEAF_MIN = 1024

_SCALARS = (type(None), bool, int, float, complex, str)
_NUMPY_KINDS = set("biufcmM")  # bool, ints, unsigned, floats, complex, timedelta, datetime


class Leaf:
    """One payload buffer of a packed object (a tensor, a numpy array or a bytes object)."""

    __slots__ = ("device", "kind", "nbytes", "value")

    def __init__(self, kind: str, value: Any, nbytes: int, device: str = "cpu") -> None:
        self.kind = kind
        self.value = value
        self.nbytes = nbytes
        self.device = device

    def host_bytes(self) -> memoryview:
        """The leaf's bytes as a flat, contiguous host memoryview (copies only when needed:
        non-contiguous tensors/arrays and tensors on a GPU)."""
        return contiguous_bytes(self.kind, self.value)


def _torch() -> Any:
    return loaded("torch")


def _is_tensor(obj: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(obj, torch.Tensor)


def contiguous_bytes(kind: str, value: Any) -> memoryview:
    """The bytes of a tensor (``kind`` "T"), array ("A") or bytes-like value, flat and on the
    host (`Leaf.host_bytes`)."""
    if kind == "T":
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.resolve_conj().resolve_neg().contiguous()  # lazy conj/neg views: values
        if tensor.numel() == 0:
            return memoryview(b"")
        try:  # fast path for dtypes numpy knows
            return memoryview(tensor.numpy()).cast("B")
        except TypeError:  # bfloat16, float8, ...: reinterpret as bytes first
            return memoryview(tensor.reshape(-1).view(_torch().uint8).numpy())
    if kind == "A":
        array = np.ascontiguousarray(value)
        return memoryview(array.reshape(-1).view(np.uint8))
    return memoryview(value).cast("B")


def _path_key(key: Any) -> str:
    return f"[{key!r}]"


def _type_path(cls: type) -> tuple[str, str]:
    return (cls.__module__, cls.__qualname__)


def _import_type(path: tuple[str, str]) -> type:
    module = importlib.import_module(path[0])
    obj: Any = module
    for part in path[1].split("."):
        obj = getattr(obj, part)
    return obj


def pack(obj: Any, root: str = "obj") -> tuple[Any, list[Leaf]]:
    """Describe ``obj``; returns (description, leaves). Raises TypeError (or ValueError for a
    container that contains itself) naming the path of the part that cannot travel.

    What arrives is exactly what was sent, or the sender refuses: the same tensor or array
    object reached twice travels once and arrives as one object (two *different* tensors that
    view the same storage travel as two copies); `nn.Parameter` stays a Parameter; a masked
    array keeps its mask and fill value; a numpy scalar keeps its dtype, fields included; a
    dataclass keeps attributes set outside its fields (``__post_init__``); namedtuples and
    dataclasses must be importable by module and name on the receiver.
    """
    packer = _Packer()
    description = packer.pack(obj, root)
    return description, packer.leaves


class _Packer:
    """One `pack` call: the leaves so far, the containers on the current path, shared leaves."""

    __slots__ = ("active", "leaves", "seen")

    def __init__(self) -> None:
        self.leaves: list[Leaf] = []
        self.active: dict[int, str] = {}  # id -> path of the containers being packed
        self.seen: dict[int, int] = {}  # id of a tensor/array/bytes leaf -> its leaf index

    def pack(self, obj: Any, path: str) -> Any:
        kind = type(obj)
        if kind in _SCALARS:
            return obj  # descriptions code containers as tuples, so raw scalars are unambiguous
        if kind is bytes and len(obj) < BYTES_LEAF_MIN:
            return ("b", obj)
        if kind is bytes or _is_tensor(obj) or isinstance(obj, np.ndarray):
            index = self.seen.get(id(obj))
            if index is not None:  # the same object again: send it once, rebuild it once
                return ("r", index)
            node = self._leaf(obj, path)
            if node[0] in _LEAF_CODES:
                self.seen[id(obj)] = node[1]
            return node
        if isinstance(obj, np.generic):
            dtype = obj.dtype.str if obj.dtype.fields is None else obj.dtype  # fields kept
            return ("g", dtype, obj.tobytes())
        if id(obj) in self.active:
            raise ValueError(
                f"{path}: refers back to {self.active[id(obj)]} (a container that contains "
                "itself cannot be sent; break the cycle first)"
            )
        self.active[id(obj)] = path
        try:
            return self._container(obj, kind, path)
        finally:
            del self.active[id(obj)]

    def _leaf(self, obj: Any, path: str) -> Any:
        leaves = self.leaves
        if _is_tensor(obj):
            torch = _torch()
            parameter = type(obj) is torch.nn.Parameter
            if type(obj) is not torch.Tensor and not parameter:
                raise TypeError(
                    f"{path}: cannot send a tensor subclass {type(obj).__qualname__}; send "
                    "x.as_subclass(torch.Tensor) (or its plain data) and rebuild it on the receiver"
                )
            if obj.is_sparse or obj.layout != torch.strided:
                raise TypeError(f"{path}: sparse/non-strided tensors are not supported ({obj.layout})")
            leaves.append(Leaf("T", obj, obj.numel() * obj.element_size(), str(obj.device)))
            dtype = str(obj.dtype).removeprefix("torch.")
            shape = tuple(obj.shape)
            return ("T", len(leaves) - 1, dtype, shape, str(obj.device), obj.requires_grad, parameter)
        if type(obj) is bytes:
            leaves.append(Leaf("B", obj, len(obj)))
            return ("B", len(leaves) - 1, len(obj))
        if isinstance(obj, np.ma.MaskedArray):
            data = self._leaf(np.ma.getdata(obj), path)
            mask = self._leaf(np.ma.getmaskarray(obj), path + ".mask")
            return ("m", data, mask, obj.fill_value)
        if type(obj) not in (np.ndarray, np.memmap):
            raise TypeError(
                f"{path}: cannot send a numpy {type(obj).__qualname__} (an ndarray subclass whose "
                "extra state would be lost); send np.asarray(x) and rebuild it on the receiver"
            )
        if obj.dtype.kind not in _NUMPY_KINDS:
            raise TypeError(
                f"{path}: numpy arrays of dtype {obj.dtype} cannot travel as raw buffers; use a numeric dtype"
            )
        leaves.append(Leaf("A", obj, obj.nbytes))
        return ("A", len(leaves) - 1, obj.dtype.str, obj.shape)

    def _container(self, obj: Any, kind: type, path: str) -> Any:
        pack = self.pack
        if kind in (dict, OrderedDict):
            items = [(k, pack(v, path + _path_key(k))) for k, v in obj.items()]
            return ("d", kind is OrderedDict, items)
        if kind is list:
            return ("l", [pack(v, f"{path}[{i}]") for i, v in enumerate(obj)])
        if kind is tuple:
            return ("t", [pack(v, f"{path}[{i}]") for i, v in enumerate(obj)])
        if isinstance(obj, tuple) and hasattr(kind, "_fields"):
            _check_importable(kind, path, "namedtuple")
            children = [pack(getattr(obj, f), f"{path}.{f}") for f in kind._fields]
            return ("n", _type_path(kind), children)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            _check_importable(kind, path, "dataclass")
            children = [(name, pack(value, f"{path}.{name}")) for name, value in _dataclass_state(obj)]
            return ("c", _type_path(kind), children)
        if isinstance(obj, dict):
            raise TypeError(
                f"{path}: cannot send a {kind.__module__}.{kind.__qualname__} (a dict subclass "
                "whose behaviour would be lost); send dict(x) and rebuild it on the receiver, "
                "e.g. collections.defaultdict(factory, received)"
            )
        raise TypeError(
            f"{path}: cannot send a {kind.__module__}.{kind.__qualname__}; supported are tensors, "
            "numpy arrays, dict/list/tuple/dataclass/namedtuple, scalars, str, bytes and None"
        )


_LEAF_CODES = ("T", "A", "B")


def _dataclass_state(obj: Any) -> list[tuple[str, Any]]:
    """Field values, then attributes set outside the fields (e.g. in ``__post_init__``)."""
    names = [f.name for f in dataclasses.fields(obj)]
    state = [(name, getattr(obj, name)) for name in names]
    extra = getattr(obj, "__dict__", {})
    state += [(name, value) for name, value in extra.items() if name not in names]
    return state


@functools.cache
def _importable(kind: type) -> bool:
    try:
        return _import_type(_type_path(kind)) is kind
    except (ImportError, AttributeError):
        return False


def _check_importable(kind: type, path: str, what: str) -> None:
    if not _importable(kind):
        raise TypeError(
            f"{path}: {what} {kind.__qualname__} cannot be rebuilt on the receiver: it is not "
            f"importable as {kind.__module__}.{kind.__qualname__} (defined inside a function?); "
            "define it at module level, or send a tuple/dict instead"
        )


def unpicklable_path(obj: Any, root: str = "obj") -> str | None:
    """The path of the first part of ``obj`` that pickle refuses (dict keys included), or None.

    Used only after encoding failed, to say where: descriptions hold the object's dict keys
    and scalars raw.
    """
    if _picklable(obj):
        return None
    children: list[tuple[str, Any]] = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not _picklable(key):
                return f"{root} key {key!r}"
            children.append((root + _path_key(key), value))
    elif isinstance(obj, (list, tuple)):
        children = [(f"{root}[{i}]", v) for i, v in enumerate(obj)]
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        children = [(f"{root}.{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    for path, child in children:
        found = unpicklable_path(child, path)
        if found is not None:
            return found
    return root


def _picklable(obj: Any) -> bool:
    if _is_tensor(obj) or isinstance(obj, np.ndarray):
        return True  # leaves travel as raw bytes
    try:
        pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - pickle raises many types
        return False
    return True


def unpack(description: Any, leaf_values: list[Any]) -> Any:
    """Rebuild the object; ``leaf_values[i]`` is leaf i as returned by `allocate_leaf` (filled)."""
    return _unpack(description, leaf_values)


def _unpack(node: Any, buffers: list[Any]) -> Any:
    if type(node) is not tuple:
        return node
    code = node[0]
    if code in _LEAF_CODES:
        return _leaf_value(node, buffers[node[1]])
    if code == "r":
        return buffers[node[1]]  # the leaf's object, rebuilt where it first appeared
    if code == "m":
        return np.ma.MaskedArray(buffers[node[1][1]], mask=buffers[node[2][1]], fill_value=node[3])
    if code == "d":
        items = [(k, _unpack(v, buffers)) for k, v in node[2]]
        return OrderedDict(items) if node[1] else dict(items)
    if code == "l":
        return [_unpack(v, buffers) for v in node[1]]
    if code == "t":
        return tuple(_unpack(v, buffers) for v in node[1])
    if code == "n":
        return _import_type(node[1])(*[_unpack(v, buffers) for v in node[2]])
    if code == "c":
        cls = _import_type(node[1])
        instance = object.__new__(cls)
        for name, child in node[2]:
            object.__setattr__(instance, name, _unpack(child, buffers))
        return instance
    if code == "g":
        return np.frombuffer(node[2], dtype=np.dtype(node[1]))[0]
    if code == "b":
        return node[1]
    raise ValueError(f"corrupt description node {code!r}")


def leaf_nodes(description: Any) -> list[tuple]:
    """The leaf nodes of a description in leaf-index order."""
    found: list[tuple] = []
    _collect(description, found)
    found.sort(key=lambda n: n[1])
    return found


def _collect(node: Any, found: list[tuple]) -> None:
    if type(node) is not tuple:
        return
    code = node[0]
    if code in _LEAF_CODES:
        found.append(node)
    elif code == "m":
        found += [node[1], node[2]]
    elif code == "d" or code == "c":
        for _, child in node[2]:
            _collect(child, found)
    elif code in ("l", "t"):
        for child in node[1]:
            _collect(child, found)
    elif code == "n":
        for child in node[2]:
            _collect(child, found)


def leaf_nbytes(node: tuple) -> int:
    """Payload size of a leaf node."""
    code = node[0]
    if code == "B":
        return node[2]
    if code == "A":
        return np.dtype(node[2]).itemsize * math.prod(node[3])
    return _torch_itemsize(node[2]) * math.prod(node[3])


@functools.cache
def _torch_itemsize(dtype_name: str) -> int:
    return getattr(import_torch(), dtype_name).itemsize


def import_torch() -> Any:
    """torch, imported now if nobody has yet (a leaf node names a torch dtype)."""
    torch = _torch()
    if torch is None:
        import torch
    return torch


def _leaf_value(node: tuple, value: Any) -> Any:
    code = node[0]
    if code == "B":
        return bytes(value)
    if code == "T" and node[6]:
        return _torch().nn.Parameter(value, requires_grad=node[5])
    if code == "T" and node[5] and (value.is_floating_point() or value.is_complex()):
        value.requires_grad_(True)
    return value  # tensors/arrays were allocated with their final dtype and shape
