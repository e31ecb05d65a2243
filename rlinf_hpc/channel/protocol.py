"""Markers and small helpers shared by the two halves of a channel."""

from __future__ import annotations

from typing import Any

from rlinf_hpc.comm import WorkHandle
from rlinf_hpc.comm.packing import pack, unpack

# Item ids below zero are markers, in order with the items on the same (sender, tag) stream.
END = -1  # the producer closed the channel
FENCE = -2  # the producer sends nothing more to this (former) consumer
FORWARDED = -3  # a former consumer has passed on everything it held
#: Several items in one message (`put_many`): its value is ``[(item_id, key, weight, item), ...]``.
BULK = -4
#: Acknowledgements leave at least this often while items are being consumed.
ACK_FLUSH_S = 1e-3


def done_handle() -> WorkHandle:
    """A handle that is complete already (local hand-over)."""
    return WorkHandle(lambda: True, lambda: None, lambda: "local hand-over")


def move_tensors(obj: Any, device: str) -> Any:
    """``obj`` with every tensor moved to ``device`` (other leaves untouched)."""
    description, leaves = pack(obj)
    if not any(leaf.kind == "T" and leaf.device != device for leaf in leaves):
        return obj
    values = [leaf.value.to(device) if leaf.kind == "T" else leaf.value for leaf in leaves]
    return unpack(description, values)
