"""The worker's half of a checkpoint: snapshot to host memory, write in the background, load.

Each (component, group rank) writes one file pair ``COMPONENT-gN`` holding the worker's
`Worker.state_dict` (only group rank 0 writes it when the state is replicated, as under data
parallelism: then any number of ranks can load it) and the rank's runtime state: RNG states
and the elastic micro-batch sizes. A worker's `Worker.sharded_state` (FSDP2) goes to
``COMPONENT-dcp/`` through torch.distributed.checkpoint, written synchronously by the group
together, and loads at any group width. `save` returns once the host copy is taken; `poll` reports
the files (name, size, sha256) once they are on disk, or raises what the writer raised.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlinf_hpc.runtime.checkpoint import (
    BackgroundWrite,
    capture_rng,
    file_name,
    host_copy,
    host_view,
    read_state,
    restore_rng,
)
from rlinf_hpc.runtime.checkpoint.sharded import has_sharded, load_sharded, save_sharded

if TYPE_CHECKING:
    from rlinf_hpc.workers.base import Worker


class WorkerCheckpointing:
    """The checkpoint state machine of one worker."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._pending: BackgroundWrite | None = None
        #: Host buffers of the last async save, reused by the next (see `host_copy`).
        self._buffers: dict[str, Any] = {}
        #: Files of the last save's sharded state (`save_sharded`), reported with the rest.
        self._sharded_records: list[dict[str, Any]] = []

    def save(self, directory: str, asynchronous: bool) -> dict[str, Any]:
        if self._pending is not None:
            self._pending.done(wait=True)  # the coordinator polls before the next save
        worker = self.worker
        owns_state = worker.group_rank == 0 or not worker.replicated_state
        state = {
            "runtime": {"rng": capture_rng(), "stage_sizes": dict(worker.stage_sizes)},
            "state": worker.state_dict() if owns_state else None,
        }
        name = file_name(worker.component, worker.group_rank)
        sharded = worker.sharded_state()
        # written now, by every group rank together (DCP's collectives run on this thread)
        self._sharded_records = (
            []
            if sharded is None
            else save_sharded(Path(directory), worker.component, worker.group_rank, sharded)
        )
        host = host_copy(state, self._buffers) if asynchronous else host_view(state)
        self._pending = BackgroundWrite(Path(directory), name, host, asynchronous)
        return {"name": name, "replicated": worker.replicated_state, "reshardable": worker.reshardable_state}

    def poll(self, wait: bool = False) -> list[dict[str, Any]] | None:
        """The written files, None while writing; raises the writer's error."""
        pending = self._pending
        if pending is None:
            return []
        if not pending.done(wait):
            return None
        self._pending = None
        if pending.error is not None:
            raise pending.error
        return [*(pending.records or []), *self._sharded_records]

    def load(self, directory: str) -> dict[str, Any]:
        """Restore from the checkpoint in ``directory``. A rank the checkpoint has no file for
        (the group grew) keeps fresh RNG states and takes the replicated state of rank 0."""
        worker = self.worker
        path = Path(directory)
        first = file_name(worker.component, 0)
        own = file_name(worker.component, worker.group_rank)
        has_own = (path / f"{own}.json").is_file()
        saved = read_state(path, own) if has_own else None
        if saved is not None:
            restore_rng(saved["runtime"]["rng"])
            worker.stage_sizes = dict(saved["runtime"]["stage_sizes"])
        if worker.replicated_state and own != first:
            saved = read_state(path, first)
        if has_sharded(path, worker.component):  # any group width: DCP re-shards
            worker.load_sharded_state(lambda state: load_sharded(path, worker.component, state))
        elif saved is None:
            raise FileNotFoundError(f"{path} has no state for {own} (its state is not replicated)")
        if saved is not None and saved["state"] is not None:
            worker.load_state_dict(saved["state"])
        return {"rank": worker.rank, "restored_runtime": has_own}
