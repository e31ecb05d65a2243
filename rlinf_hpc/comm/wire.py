"""Envelopes: the first MPI message of every transfer, and the batch format for small ones.

Layout: 4-byte little-endian header length, the pickled header, then inline payload bytes.
Payload bytes are copied raw into the tail, never pickled. The header is a tuple:

* ``("S", tag, description, inline)`` one object; with ``inline`` its leaves follow in the tail,
  otherwise they arrive as separate payload messages (chunked) right after the envelope.
* ``("M", [(tag, description), ...])`` a batch of small objects, all leaves inline in order.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from typing import Any

_LENGTH = struct.Struct("<I")


def encode(header: Any, payloads: Sequence[memoryview | bytes] = ()) -> bytearray:
    """One contiguous envelope: length, pickled header, raw payload bytes."""
    head = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
    size = _LENGTH.size + len(head) + sum(len(p) for p in payloads)
    out = bytearray(size)
    _LENGTH.pack_into(out, 0, len(head))
    offset = _LENGTH.size
    out[offset : offset + len(head)] = head
    offset += len(head)
    for payload in payloads:
        out[offset : offset + len(payload)] = payload
        offset += len(payload)
    return out


def decode(envelope: bytearray | memoryview) -> tuple[Any, memoryview]:
    """(header, view of the inline payload tail)."""
    view = memoryview(envelope)
    (length,) = _LENGTH.unpack_from(view, 0)
    start = _LENGTH.size
    header = pickle.loads(view[start : start + length])
    return header, view[start + length :]
