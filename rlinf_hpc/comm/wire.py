"""Envelopes: the first MPI message of every transfer, and the batch format for small ones.

Layout: 4-byte little-endian word (header length; its top bit set when a CRC32 follows), the
optional 4-byte CRC32 of everything after it, the pickled header, then inline payload bytes.
Payload bytes are copied raw into the tail, never pickled. The header is a tuple:

* ``("S", tag, description, inline, chunk, ...)`` one object; with ``inline`` its leaves follow
  in the tail, otherwise they arrive as separate payload messages (chunked) right after the
  envelope; in integrity mode its last element is the list of per-leaf CRC32s.
* ``("M", [blob, ...])`` a batch of small objects: each blob is one message's pickled
  ``(tag, description)`` (encoded when the message was queued, so that one bad message fails
  at its own ``isend``), all leaves inline in order.

>>> envelope = encode(("M", [encode_message(7, ("l", [1, 2]))]), [b"raw"], checksum=True)
>>> header, tail = decode(envelope)
>>> [decode_message(blob) for blob in header[1]], bytes(tail)
([(7, ('l', [1, 2]))], b'raw')
"""

from __future__ import annotations

import pickle
import struct
import zlib
from collections.abc import Sequence
from typing import Any

_WORD = struct.Struct("<I")
_CHECKED = 1 << 31


class CorruptMessageError(RuntimeError):
    """An envelope or payload that does not decode, or fails its checksum."""


def encode_message(tag: Any, description: Any) -> bytes:
    """One small message's header blob (raises what pickle raises for unpicklable parts)."""
    return pickle.dumps((tag, description), protocol=pickle.HIGHEST_PROTOCOL)


def decode_message(blob: bytes | memoryview) -> tuple[Any, Any]:
    return pickle.loads(blob)


def encode(header: Any, payloads: Sequence[memoryview | bytes] = (), checksum: bool = False) -> bytearray:
    """One contiguous envelope: length word, optional CRC32, pickled header, raw payload bytes."""
    head = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
    prefix = _WORD.size * (2 if checksum else 1)
    size = prefix + len(head) + sum(len(p) for p in payloads)
    out = bytearray(size)
    _WORD.pack_into(out, 0, len(head) | (_CHECKED if checksum else 0))
    offset = prefix
    out[offset : offset + len(head)] = head
    offset += len(head)
    for payload in payloads:
        out[offset : offset + len(payload)] = payload
        offset += len(payload)
    if checksum:
        _WORD.pack_into(out, _WORD.size, zlib.crc32(memoryview(out)[prefix:]))
    return out


def decode(envelope: bytearray | memoryview) -> tuple[Any, memoryview]:
    """(header, view of the inline payload tail); `CorruptMessageError` if it does not decode."""
    view = memoryview(envelope)
    if len(view) < _WORD.size:
        raise CorruptMessageError(f"envelope of {len(view)} bytes is shorter than its length word")
    (word,) = _WORD.unpack_from(view, 0)
    length, checked = word & ~_CHECKED, bool(word & _CHECKED)
    start = _WORD.size * (2 if checked else 1)
    if start + length > len(view):
        raise CorruptMessageError(
            f"envelope of {len(view)} bytes announces a {length}-byte header (truncated or torn)"
        )
    if checked:
        (expected,) = _WORD.unpack_from(view, _WORD.size)
        actual = zlib.crc32(view[start:])
        if actual != expected:
            raise CorruptMessageError(
                f"envelope of {len(view)} bytes failed its checksum ({actual:#010x} != {expected:#010x})"
            )
    try:
        header = pickle.loads(view[start : start + length])
    except Exception as error:  # noqa: BLE001 - any unpickling failure means torn bytes
        raise CorruptMessageError(
            f"envelope of {len(view)} bytes does not decode ({type(error).__name__}: {error}); "
            "rerun with [comm] verify = true to check every message"
        ) from error
    return header, view[start + length :]


def checksum(data: memoryview | bytes) -> int:
    """CRC32 of one payload leaf."""
    return zlib.crc32(data)
