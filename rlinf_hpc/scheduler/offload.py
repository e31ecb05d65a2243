"""Context switching of a component's tensors between its device and host memory.

`StateOffloader.offload` copies a flat ``{name: tensor}`` state to host memory (pinned when it
comes from a GPU) and optionally compresses it with zstd; `onload` restores it bit for bit, into
the caller's tensors when given (so references held elsewhere — an optimizer's, a model's — stay
valid). `ModuleSwitch` applies that to an ``nn.Module`` (parameters, buffers, gradients) and a
torch optimizer's state, swapping ``.data`` in place.

Compression modes, measured in tools/bench_switch.py (weights barely compress as they are):

* ``plain``: zstd over the raw bytes.
* ``byte_planes``: bytes regrouped by significance before zstd (all high bytes, then the next…):
  exponent bytes of float weights repeat a lot, mantissa bytes do not.
* ``delta``: XOR against the previous snapshot of the same state, then byte planes + zstd: weights
  that changed a little between two switches become mostly zero bits. The previous snapshot's raw
  bytes stay in host memory as the base, so delta shrinks what is compressed, moved or written,
  not the host memory held.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import zstandard

Mode = Literal["none", "plain", "byte_planes", "delta"]


@dataclass(frozen=True)
class OffloadOptions:
    """How a state leaves the device."""

    mode: Mode = "none"
    level: int = 1
    #: zstd worker threads: 0 = in the calling thread, -1 = one per core.
    threads: int = -1

    def __post_init__(self) -> None:
        if self.mode not in ("none", "plain", "byte_planes", "delta"):
            raise ValueError(f"offload mode must be none, plain, byte_planes or delta, got {self.mode!r}")


@dataclass
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: torch.device
    host: torch.Tensor | None = None  # uncompressed host copy
    blob: bytes | None = None  # compressed bytes
    base: np.ndarray | None = None  # raw bytes of the previous snapshot (delta mode)


@dataclass
class Snapshot:
    """A state in host memory, and what it cost."""

    entries: dict[str, _Entry]
    raw_bytes: int
    stored_bytes: int
    seconds: float
    mode: Mode
    key: str = "state"

    @property
    def ratio(self) -> float:
        """Raw bytes / stored bytes (1.0 when not compressed)."""
        return self.raw_bytes / max(self.stored_bytes, 1)


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


def _split_planes(data: np.ndarray, itemsize: int) -> np.ndarray:
    if itemsize == 1 or data.size == 0:
        return data
    return np.ascontiguousarray(data.reshape(-1, itemsize).T).reshape(-1)


def _join_planes(data: np.ndarray, itemsize: int) -> np.ndarray:
    if itemsize == 1 or data.size == 0:
        return data
    return np.ascontiguousarray(data.reshape(itemsize, -1).T).reshape(-1)


class StateOffloader:
    """Offload/onload flat tensor states; keeps the last raw snapshot per key for ``delta``."""

    def __init__(self, options: OffloadOptions | None = None) -> None:
        self.options = options or OffloadOptions()
        self._bases: dict[str, dict[str, np.ndarray]] = {}
        #: Host buffers of onloaded snapshots, reused by the next offload of the same tensor
        #: (allocating and first-touching host memory costs as much as the copy itself).
        self._pool: dict[tuple[str, str], torch.Tensor] = {}
        params = {"level": self.options.level, "threads": self.options.threads}
        self._compressor = zstandard.ZstdCompressor(**params)
        self._decompressor = zstandard.ZstdDecompressor()

    def offload(self, state: dict[str, torch.Tensor], key: str = "state") -> Snapshot:
        """Copy ``state`` to host memory (and compress it per ``options.mode``)."""
        start = time.perf_counter()
        mode = self.options.mode
        entries: dict[str, _Entry] = {}
        raw = stored = 0
        bases = self._bases.setdefault(key, {}) if mode == "delta" else {}
        for name, tensor in state.items():
            entry = _Entry(tensor.dtype, tuple(tensor.shape), tensor.device)
            raw += tensor.numel() * tensor.element_size()
            if mode == "none":
                pin = tensor.is_cuda
                entry.host = self._host_buffer(key, name, tensor, pin)
                entry.host.copy_(tensor.detach(), non_blocking=pin)
                stored += entry.host.numel() * entry.host.element_size()
            else:
                data = _bytes_of(tensor.detach().cpu() if tensor.is_cuda else tensor)
                if mode == "delta":
                    base = bases.get(name)
                    bases[name] = data.copy()  # the next snapshot's base
                    if base is not None and base.size == data.size:
                        entry.base = base
                        data = np.bitwise_xor(data, base)
                if mode in ("byte_planes", "delta"):
                    data = _split_planes(data, tensor.element_size())
                entry.blob = self._compressor.compress(data.tobytes())
                stored += len(entry.blob)
            entries[name] = entry
        if mode == "none" and any(e.device.type == "cuda" for e in entries.values()):
            torch.cuda.synchronize()
        return Snapshot(entries, raw, stored, time.perf_counter() - start, mode, key)

    def _host_buffer(self, key: str, name: str, tensor: torch.Tensor, pin: bool) -> torch.Tensor:
        pooled = self._pool.pop((key, name), None)
        if pooled is not None and pooled.shape == tensor.shape and pooled.dtype == tensor.dtype:
            return pooled
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)

    def peek(self, snapshot: Snapshot) -> dict[str, torch.Tensor]:
        """The snapshot's tensors in host memory, without consuming it (a checkpoint of an
        offloaded component reads these; nothing moves to the device)."""
        peeked: dict[str, torch.Tensor] = {}
        for name, entry in snapshot.entries.items():
            peeked[name] = entry.host if entry.host is not None else self._decode(snapshot, entry)
        return peeked

    def _decode(self, snapshot: Snapshot, entry: _Entry) -> torch.Tensor:
        assert entry.blob is not None
        data = np.frombuffer(self._decompressor.decompress(entry.blob), dtype=np.uint8)
        itemsize = torch.empty((), dtype=entry.dtype).element_size()
        if snapshot.mode in ("byte_planes", "delta"):
            data = _join_planes(data, itemsize)
        if entry.base is not None:
            data = np.bitwise_xor(data, entry.base)
        return _from_bytes(data, entry.dtype, entry.shape)

    def onload(
        self, snapshot: Snapshot, out: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Restore a snapshot bit for bit: into ``out``'s tensors when given, else into new
        tensors on each tensor's original device."""
        restored: dict[str, torch.Tensor] = {}
        for name, entry in snapshot.entries.items():
            value = entry.host if entry.host is not None else self._decode(snapshot, entry)
            target = out.get(name) if out is not None else None
            if target is not None:
                target.copy_(value, non_blocking=value.is_pinned())
                restored[name] = target
            else:
                restored[name] = value.to(entry.device, copy=entry.host is not None)
            if entry.host is not None and target is not None:
                self._pool[(snapshot.key, name)] = entry.host  # copied out: reusable
        snapshot.entries = {}  # consumed: a snapshot is onloaded once
        return restored


def _from_bytes(data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if data.size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(data.copy()).view(dtype).reshape(shape)


class ModuleSwitch:
    """Take a model (parameters, gradients, buffers) and its optimizer state off the device
    and put them back, bit for bit, keeping every ``nn.Parameter`` object (``.data`` swaps).

    >>> model = torch.nn.Linear(4, 2)
    >>> before = model.weight.detach().clone()
    >>> switch = ModuleSwitch(model)
    >>> snapshot = switch.offload()
    >>> model.weight.numel()  # device memory released
    0
    >>> seconds = switch.onload()
    >>> torch.equal(model.weight, before)
    True
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        options: OffloadOptions | None = None,
        key: str = "module",
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.offloader = StateOffloader(options)
        self.key = key
        self._snapshot: Snapshot | None = None

    def _tensors(self) -> dict[str, tuple[torch.Tensor, Any, Any]]:
        """name -> (tensor, owner, attribute) for everything the switch moves."""
        found: dict[str, tuple[torch.Tensor, Any, Any]] = {}
        for name, param in self.module.named_parameters():
            found[f"param:{name}"] = (param.data, param, "data")
            if param.grad is not None:
                found[f"grad:{name}"] = (param.grad, param, "grad")
        for name, buffer in self.module.named_buffers():
            owner_name, _, attr = name.rpartition(".")
            owner = self.module.get_submodule(owner_name) if owner_name else self.module
            found[f"buffer:{name}"] = (buffer, owner, attr)
        if self.optimizer is not None:
            for index, state in enumerate(self.optimizer.state.values()):
                for attr, value in state.items():
                    if isinstance(value, torch.Tensor):
                        found[f"optim:{index}:{attr}"] = (value, state, attr)
        return found

    def offload(self) -> Snapshot:
        """Move everything to host memory and release the device copies."""
        if self._snapshot is not None:
            raise RuntimeError(f"'{self.key}' is offloaded already")
        tensors = self._tensors()
        snapshot = self.offloader.offload({k: t for k, (t, _, _) in tensors.items()}, self.key)
        self._release(tensors)
        self._snapshot = snapshot
        return snapshot

    @staticmethod
    def _release(tensors: dict[str, tuple[torch.Tensor, Any, Any]]) -> None:
        """Drop the references to ``tensors`` (empty tensors of the same dtype and device)."""
        for tensor, owner, attr in tensors.values():
            empty = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
            if attr == "data":
                owner.data = empty
            elif attr == "grad":
                owner.grad = None
            elif isinstance(owner, dict):
                owner[attr] = empty
            else:
                setattr(owner, attr, empty)

    @contextmanager
    def host_view(self) -> Iterator[None]:
        """While offloaded: point the module's parameters, buffers and optimizer state at the
        host copies for the body (e.g. a checkpoint's `state_dict`), then release them again."""
        if self._snapshot is None:
            yield
            return
        self._attach(self.offloader.peek(self._snapshot))
        try:
            yield
        finally:
            self._release(self._tensors())

    def onload(self) -> float:
        """Put everything back on its device; returns the seconds it took."""
        if self._snapshot is None:
            raise RuntimeError(f"'{self.key}' is not offloaded")
        start = time.perf_counter()
        restored = self.offloader.onload(self._snapshot)
        self._snapshot = None
        self._attach(restored)
        return time.perf_counter() - start

    def _attach(self, restored: dict[str, torch.Tensor]) -> None:
        params = dict(self.module.named_parameters())
        states = list(self.optimizer.state.values()) if self.optimizer is not None else []
        for key, value in restored.items():
            kind, _, name = key.partition(":")
            if kind == "param":
                params[name].data = value
            elif kind == "grad":
                params[name].grad = value
            elif kind == "buffer":
                owner_name, _, attr = name.rpartition(".")
                owner = self.module.get_submodule(owner_name) if owner_name else self.module
                setattr(owner, attr, value)
            else:
                index, _, attr = name.partition(":")
                states[int(index)][attr] = value
