"""Sharded state (FSDP2's DTensors) in a checkpoint, through torch.distributed.checkpoint.

Every rank of the component's group calls `save_sharded` together (the group's process group
is the default one on its ranks): DCP writes ``COMPONENT-dcp/`` in the step directory, one
``__R_0.distcp`` per group rank and rank 0's ``.metadata``. Each rank returns the records
(size, sha256) of the files it wrote, which the manifest vouches for like every other file.
`load_sharded` reads them into a state of the same structure at any group width: DCP re-shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlinf_hpc.errors import UserError
from rlinf_hpc.runtime.checkpoint.files import file_digest, fsync_path


def sharded_dir(directory: Path, component: str) -> Path:
    return directory / f"{component}-dcp"


def save_sharded(
    directory: Path, component: str, group_rank: int, state: dict[str, Any]
) -> list[dict[str, Any]]:
    """Write this rank's shards of ``state`` (every group rank at once); its file records."""
    import torch.distributed.checkpoint as dcp

    target = sharded_dir(directory, component)
    dcp.save(state, checkpoint_id=str(target))
    mine = sorted(target.glob(f"__{group_rank}_*.distcp"))
    if group_rank == 0:
        mine.append(target / ".metadata")
    records = []
    for path in mine:
        fsync_path(path)
        records.append(
            {"name": f"{target.name}/{path.name}", "size": path.stat().st_size, "sha256": file_digest(path)}
        )
    if group_rank == 0:
        fsync_path(target)
    return records


def has_sharded(directory: Path, component: str) -> bool:
    return (sharded_dir(directory, component) / ".metadata").is_file()


def load_sharded(directory: Path, component: str, state: dict[str, Any]) -> None:
    """Fill ``state`` (this rank's shards, any group width) from the checkpoint, in place;
    `UserError` saying why when the saved state does not fit it (another model or backend)."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(state, checkpoint_id=str(sharded_dir(directory, component)))
    except (RuntimeError, ValueError, KeyError) as exc:  # DCP's CheckpointException is a RuntimeError
        raise UserError(
            f"the sharded state of '{component}' in {directory} does not load into this job's "
            f"{component} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else exc}). "
            "Resume with the model and train_backend it was saved with, or start afresh with "
            "--resume never."
        ) from None
