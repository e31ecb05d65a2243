"""Writing and reading one state file pair: ``NAME.safetensors`` (tensors) and ``NAME.json``
(the skeleton), each fsynced, with its size and sha256 for the manifest. Reading never unpickles:
safetensors holds raw tensors and JSON holds the rest.

The safetensors file is written here rather than by `safetensors.torch.save_file`, which first
serializes everything into one bytes object (a second copy of the state in memory, and a pass
of its own) and cannot hash as it goes. The format is safetensors' own (8-byte header length,
JSON header, raw little-endian data), read back with `safetensors.torch.load_file`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import queue
import struct
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlinf_hpc.runtime.checkpoint.state import flatten, unflatten

if TYPE_CHECKING:
    import torch

#: Bytes written and hashed at a time.
_CHUNK = 8 << 20


@functools.cache
def _dtype_names() -> dict[Any, str]:
    """safetensors' names of torch dtypes (built on first use: importing this module must not
    import torch, which ranks without torch code never load)."""
    import torch

    return {
        torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
        torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
        torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
        torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    }  # fmt: skip


def file_name(component: str, group_rank: int) -> str:
    """The stem of one worker's file pair in a checkpoint (``actor-g0``)."""
    return f"{component}-g{group_rank}"


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb", buffering=0) as handle:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while True:
            n = handle.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
    return digest.hexdigest()


class _Hasher:
    """sha256 of the chunks handed to `update`, computed by a thread while the caller writes
    them (hashlib releases the GIL on large buffers): hashing costs no pass of its own."""

    def __init__(self) -> None:
        self._digest = hashlib.sha256()
        self._queue: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="checkpoint-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (chunk := self._queue.get()) is not None:
            self._digest.update(chunk)

    def update(self, chunk: memoryview) -> None:
        self._queue.put(chunk)

    def hexdigest(self) -> str:
        self._queue.put(None)
        self._thread.join()
        return self._digest.hexdigest()


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    import torch

    flat = tensor.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Stream ``tensors`` from their own memory into ``path``, hashing as it goes; fsynced."""
    header: dict[str, Any] = {}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"checkpoint tensor {name} must be a contiguous host tensor")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _dtype_names()[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    hasher = _Hasher()
    with path.open("wb", buffering=0) as handle:
        chunks = [memoryview(struct.pack("<Q", len(encoded))), memoryview(encoded)]
        for tensor in tensors.values():
            data = _raw_bytes(tensor)
            chunks.extend(data[start : start + _CHUNK] for start in range(0, len(data), _CHUNK))
        for chunk in chunks:
            written = handle.write(chunk)
            while written < len(chunk):  # a short write (signals, some file systems)
                written += handle.write(chunk[written:])
            hasher.update(chunk)
        os.fsync(handle.fileno())
    return {"name": path.name, "size": 8 + len(encoded) + offset, "sha256": hasher.hexdigest()}


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a rename is durable once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> dict[str, Any]:
    """Write ``data`` to ``path`` and fsync it; returns its ``{"name", "size", "sha256"}``."""
    with path.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return {"name": path.name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_state(directory: Path, name: str, state: Any) -> list[dict[str, Any]]:
    """Write ``state`` (host tensors: see `host_copy` / `host_view`) as
    ``directory/name.{safetensors,json}``; returns the two files' ``{"name", "size", "sha256"}``."""
    tensors, skeleton = flatten(state)
    return [
        _write_safetensors(directory / f"{name}.safetensors", tensors),
        write_durable(directory / f"{name}.json", json.dumps(skeleton).encode()),
    ]


def read_state(directory: Path, name: str, device: str = "cpu") -> Any:
    """Read what `write_state` wrote (checksums are the manifest's business)."""
    from safetensors.torch import load_file

    tensors = load_file(str(directory / f"{name}.safetensors"), device=device)
    skeleton = json.loads((directory / f"{name}.json").read_text(encoding="utf-8"))
    return unflatten(tensors, skeleton)


class BackgroundWrite:
    """One state being written by a thread (or at once, when not asynchronous)."""

    def __init__(self, directory: Path, name: str, state: Any, asynchronous: bool) -> None:
        self.records: list[dict[str, Any]] | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if asynchronous:
            self._thread = threading.Thread(
                target=self._run, args=(directory, name, state), name="checkpoint-write", daemon=True
            )
            self._thread.start()
        else:
            self._run(directory, name, state)

    def _run(self, directory: Path, name: str, state: Any) -> None:
        try:
            self.records = write_state(directory, name, state)
        except BaseException as exc:  # noqa: BLE001 - reported by poll() on the command thread
            self.error = exc

    def done(self, wait: bool = False) -> bool:
        if self._thread is not None and wait:
            self._thread.join()
        return self._thread is None or not self._thread.is_alive()
