"""Where received leaves land: fresh host buffers of the final dtype and shape, the caller's
``out=`` buffers when they fit, or small leaves rebuilt from the bytes they arrived in. The
layout of leaves is `packing`'s."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rlinf_hpc.comm.packing import Leaf, import_torch, leaf_nbytes

#: Receive buffers at least this large are allocated through numpy (see `allocate_leaf`).
LARGE_ALLOCATION = 1 << 20
#: Transparent huge page size on x86-64 and most aarch64 kernels.
HUGE_PAGE = 2 << 20


def _host_buffer(nbytes: int) -> np.ndarray:
    """``nbytes`` of fresh host memory, 2 MB-aligned once it can hold a huge page.

    numpy asks the kernel for transparent huge pages on big allocations, but malloc's mmap
    returns memory 16 bytes past a 4 KB boundary, so only the 2 MB-aligned middle of a buffer
    can be huge pages: a 4 MB buffer gets at most one, the rest faults in 4 KB at a time.
    Over-allocating by one huge page and starting at the aligned offset makes the whole buffer
    eligible (the slack is never touched, so never resident). Measured here, 8 ranks each
    receiving seven 4 MB messages into fresh buffers: 66 ms unaligned, 38 ms aligned (MPI's
    own Alltoallv into one 32 MB buffer: 51-53 ms).
    """
    if nbytes < HUGE_PAGE:
        return np.empty(nbytes, dtype=np.uint8)
    raw = np.empty(nbytes + HUGE_PAGE, dtype=np.uint8)
    offset = -raw.__array_interface__["data"][0] % HUGE_PAGE
    return raw[offset : offset + nbytes]


def allocate_leaf(node: tuple, pin: bool = False) -> tuple[Any, memoryview]:
    """A host object to receive leaf ``node`` into, and a writable byte view of it.

    Large tensors are carved out of a numpy byte array (see `_host_buffer`): first-touch page
    faults cost a fraction of what they cost in memory from torch's CPU allocator (measured
    here: 6 vs 1.8 GB/s receiving 64 MB).
    """
    code = node[0]
    if code == "B":
        buffer = bytearray(node[2])
        return buffer, memoryview(buffer)
    if code == "A":
        dtype = np.dtype(node[2])
        nbytes = dtype.itemsize * math.prod(node[3])
        if nbytes >= HUGE_PAGE:
            array = _host_buffer(nbytes).view(dtype).reshape(node[3])
        else:
            array = np.empty(node[3], dtype=dtype)
        return array, memoryview(array.reshape(-1).view(np.uint8))
    torch = import_torch()
    dtype = getattr(torch, node[2])
    nbytes = leaf_nbytes(node)
    if nbytes >= LARGE_ALLOCATION and not pin:
        raw = _host_buffer(nbytes)
        return torch.from_numpy(raw).view(dtype).reshape(node[3]), memoryview(raw)
    tensor = torch.empty(node[3], dtype=dtype, pin_memory=pin)
    if tensor.numel() == 0:
        return tensor, memoryview(bytearray(0))
    return tensor, memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def leaf_from_bytes(node: tuple, data: memoryview) -> Any:
    """Leaf ``node`` built from a copy of ``data`` (small inline payloads: one copy, no view
    juggling, which costs more than the copy for kilobyte tensors)."""
    code = node[0]
    if code == "B":
        return bytes(data)
    if len(data) == 0:
        return allocate_leaf(node)[0]
    shape = node[3]
    if code == "A":
        array = np.frombuffer(bytearray(data), dtype=np.dtype(node[2]))
        return array if len(shape) == 1 else array.reshape(shape)
    torch = import_torch()
    tensor = torch.frombuffer(bytearray(data), dtype=getattr(torch, node[2]))
    return tensor if len(shape) == 1 else tensor.reshape(shape)  # reshape costs more than the copy


def _signature(kind: str, dtype: str, shape: tuple[int, ...]) -> str:
    return f"{'tensor' if kind == 'T' else 'array'} {dtype} {tuple(shape)}"


def out_mismatch(nodes: list[tuple], out_leaves: list[Leaf]) -> str | None:
    """Why a message with leaf ``nodes`` does not fit ``out_leaves``; None when it does."""
    if len(nodes) != len(out_leaves):
        return f"the message has {len(nodes)} tensor/array leaves, out= has {len(out_leaves)}"
    for index, (node, leaf) in enumerate(zip(nodes, out_leaves, strict=True)):
        if leaf.kind == "B" or node[0] == "B":
            return f"leaf {index} is bytes, which cannot be received in place"
        want = _signature(node[0], np.dtype(node[2]).str if node[0] == "A" else node[2], node[3])
        value = leaf.value
        dtype = value.dtype.str if leaf.kind == "A" else str(value.dtype).removeprefix("torch.")
        have = _signature(leaf.kind, dtype, tuple(value.shape))
        if want != have:
            return f"leaf {index}: the message has {want}, out= has {have}"
    return None


def writable_view(leaf: Leaf) -> memoryview | None:
    """A byte view straight into an out= buffer, when it can be written in place."""
    value = leaf.value
    if leaf.kind == "T":
        if value.device.type != "cpu" or not value.is_contiguous():
            return None
        if value.numel() == 0:
            return memoryview(bytearray(0))
        import torch

        return memoryview(value.detach().reshape(-1).view(torch.uint8).numpy())
    if leaf.kind == "A" and value.flags.c_contiguous and value.flags.writeable:
        return memoryview(value.reshape(-1).view(np.uint8))
    return None


def copy_leaf(leaf: Leaf, value: Any) -> None:
    if leaf.kind == "T":
        leaf.value.copy_(value)
    else:
        leaf.value[...] = value
