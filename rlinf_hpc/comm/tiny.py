"""The fast path for tiny messages: one small CPU tensor or numpy array, sent with blocking `send`.

Latency of such messages is what the general path loses most to Python: describing the object,
pickling its header, a send record and a handle on the sender, unpickling and rebuilding on the
receiver cost several times what MPI itself needs for a kilobyte. Here the envelope's header (the
exact bytes the general path would write: ``("S", tag, leaf node, inline, 0)``) is built once per
(tag, dtype, shape) and reused, so a send is a lookup, one copy and the MPI call; the receiver
keeps a matching cache from header bytes to decoded headers, so nothing is unpickled either.
The wire format is unchanged: a receiver without the cache decodes these envelopes as any other.

Only exact ``torch.Tensor`` (on CPU, contiguous, no autograd, a dtype numpy knows) and exact
``np.ndarray`` (C-contiguous, numeric) qualify; everything else takes the general path.

>>> import numpy as np
>>> from rlinf_hpc.comm import wire
>>> encoder, decoder = TinyEncoder(limit=1024), TinyDecoder()
>>> envelope = encoder.envelope(np.arange(3, dtype=np.int16), tag="t")
>>> header, tail = wire.decode(envelope)
>>> header[:2], header[3], bytes(tail)
(('S', 't'), True, b'\\x00\\x00\\x01\\x00\\x02\\x00')
>>> decoder.decode(envelope)[2], decoder.decode(envelope)[0][1]  # the second one from the cache
(True, 't')
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from rlinf_hpc.comm import wire
from rlinf_hpc.comm.packing import pack
from rlinf_hpc.imports import loaded

_WORD = struct.Struct("<I")
#: Headers longer than this are not cached on the receiver (tiny-path headers are ~70 bytes).
_HEADER_MAX = 256
#: Either cache is cleared when it holds this many entries (a job uses a handful of shapes).
_CACHE_MAX = 1024
_NUMPY_KINDS = frozenset("biufc")


class TinyEncoder:
    """Envelopes of tiny tensors/arrays from cached headers (sender side)."""

    def __init__(self, limit: int) -> None:
        #: Only messages below this many payload bytes take the fast path.
        self.limit = limit
        self._heads: dict[tuple, bytes] = {}

    def envelope(self, obj: Any, tag: Any) -> bytes | None:
        """The envelope of ``obj`` (same bytes as the general path's), or None when ``obj``
        does not qualify."""
        kind = type(obj)
        torch = loaded("torch")
        if torch is not None and kind is torch.Tensor:
            if obj.nbytes >= self.limit or obj.requires_grad or not obj.is_cpu or not obj.is_contiguous():
                return None
            if obj.layout != torch.strided or obj.is_conj() or obj.is_neg():
                return None
            key: tuple = (tag, obj.dtype, obj.shape)
            try:
                data = obj.numpy()
            except (TypeError, RuntimeError):  # bfloat16 and other dtypes numpy lacks
                return None
        elif kind is np.ndarray:
            if obj.nbytes >= self.limit or not obj.flags.c_contiguous:
                return None
            if obj.dtype.kind not in _NUMPY_KINDS or obj.dtype.fields:
                return None
            key = (tag, obj.dtype.str, obj.shape)
            data = obj
        else:
            return None
        try:
            head = self._heads.get(key)
        except TypeError:  # an unhashable tag: the general path says what is wrong
            return None
        if head is None:
            head = self._head(obj, tag, key)
            if head is None:  # a tag pickle refuses: the general path names what is wrong
                return None
        return b"".join((head, data))  # one copy; MPI sends from read-only bytes

    def _head(self, obj: Any, tag: Any, key: tuple) -> bytes | None:
        description, _ = pack(obj)
        try:
            head = bytes(wire.encode(("S", tag, description, True, 0)))
        except Exception:  # noqa: BLE001 - pickle raises many types
            return None
        if len(self._heads) >= _CACHE_MAX:
            self._heads.clear()
        self._heads[key] = head
        return head


class TinyDecoder:
    """Envelopes decoded, with a cache for those that hold one plain inline leaf (receiver side)."""

    def __init__(self) -> None:
        self._known: dict[bytes, tuple] = {}

    def decode(self, envelope: bytearray | bytes) -> tuple[Any, memoryview, bool]:
        """``(header, payload tail, tiny)`` of any envelope (as `wire.decode`, which raises
        `CorruptMessageError`). ``tiny``: the header is ``("S", tag, node, True, 0)`` with one
        plain tensor/array leaf; such headers come from a cache keyed by their bytes, so a
        repeated one is never unpickled. Checksummed envelopes (integrity mode) are always
        decoded and checked by `wire.decode`: their length word has its top bit set."""
        (length,) = _WORD.unpack_from(envelope, 0)
        if length <= _HEADER_MAX and len(envelope) >= _WORD.size + length:
            view = memoryview(envelope)
            end = _WORD.size + length
            key = bytes(view[_WORD.size : end])
            known = self._known.get(key)
            if known is not None:
                return known, view[end:], True
            header, tail = wire.decode(envelope)
            if not _one_inline_leaf(header):
                return header, tail, False
            if len(self._known) >= _CACHE_MAX:
                self._known.clear()
            self._known[key] = header
            return header, tail, True
        header, tail = wire.decode(envelope)
        return header, tail, False


def _one_inline_leaf(header: Any) -> bool:
    """An ``("S", tag, node, True, 0)`` header whose node is one plain tensor/array leaf: the
    leaf's value is the object (nothing for `unpack` to add), and nothing in the header is
    mutable, so one decoded copy may serve every message with the same bytes."""
    if header[0] != "S" or len(header) != 5 or header[3] is not True:
        return False
    node = header[2]
    if type(node) is not tuple or node[1:2] != (0,):
        return False
    if node[0] == "A":
        return len(node) == 4
    # a plain tensor: one that requires grad or is a Parameter is rebuilt by `unpack`
    return node[0] == "T" and len(node) == 7 and node[4:] == ("cpu", False, False)
