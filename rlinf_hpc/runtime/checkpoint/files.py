"""Writing and reading one state file pair: ``NAME.safetensors`` (tensors) and ``NAME.json``
(the skeleton), each fsynced, with its size and sha256 for the manifest. Reading never unpickles:
safetensors holds raw tensors and JSON holds the rest."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from rlinf_hpc.runtime.checkpoint.state import flatten, unflatten

#: Bytes read at a time when hashing.
_CHUNK = 8 << 20


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


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _record(path: Path) -> dict[str, Any]:
    _fsync(path)
    return {"name": path.name, "size": path.stat().st_size, "sha256": file_digest(path)}


def write_state(directory: Path, name: str, state: Any) -> list[dict[str, Any]]:
    """Write ``state`` (host tensors: see `host_copy`) as ``directory/name.{safetensors,json}``;
    returns the two files' ``{"name", "size", "sha256"}``."""
    tensors, skeleton = flatten(state)
    tensor_file = directory / f"{name}.safetensors"
    skeleton_file = directory / f"{name}.json"
    save_file(tensors, str(tensor_file))
    skeleton_file.write_text(json.dumps(skeleton), encoding="utf-8")
    return [_record(tensor_file), _record(skeleton_file)]


def read_state(directory: Path, name: str, device: str = "cpu") -> Any:
    """Read what `write_state` wrote (checksums are the manifest's business)."""
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
