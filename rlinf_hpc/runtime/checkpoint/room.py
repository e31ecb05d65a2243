"""Room for checkpoints: what one takes (measured from a save, read from a manifest, or
estimated from the workers' state) against the free space of its filesystem.

At the start a checkpoint directory with less room than one checkpoint is refused (`UserError`,
with the numbers), and one with less than ``checkpoint.keep`` of them is warned of; a periodic
save that cannot fit is not started (it would fill the disk, and every record of the run with
it, before failing).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

from rlinf_hpc.errors import UserError
from rlinf_hpc.log import get_logger
from rlinf_hpc.runtime.disk import free_bytes

log = get_logger("checkpoint")

#: Room kept beyond a checkpoint's own size (its manifest, the run's records beside it).
MARGIN_BYTES = 64 << 10


def manifest_bytes(manifest: dict[str, Any]) -> int:
    """The bytes of a committed checkpoint, from its manifest."""
    return sum(int(record.get("size", 0)) for record in manifest.get("files", {}).values())


def state_bytes(state: Any) -> int:
    """Bytes of the tensors and arrays in a state (nested dicts, lists, tuples)."""
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    nbytes = getattr(state, "nbytes", None)  # numpy arrays; tensors below
    if hasattr(state, "element_size") and hasattr(state, "numel"):
        return int(state.element_size() * state.numel())
    return int(nbytes) if isinstance(nbytes, int) else 0


def check_room(root: Path, size: int, keep: int, source: str, refuse: bool = True) -> None:
    """Refuse (``refuse``: at the start) a checkpoint directory without room for one checkpoint
    of ``size`` bytes (``source``: where the size comes from); warn when ``keep`` of them do not
    fit."""
    free = free_bytes(root)
    if free is None or size <= 0:
        return
    if free < size + MARGIN_BYTES and refuse:
        raise UserError(
            f"checkpoint directory '{root}' has {free / 1e6:.1f} MB free, less than one checkpoint of "
            f"this job ({size / 1e6:.1f} MB, {source}) and the run's own records: every save would "
            "fail. Free space there, point --run-dir (or checkpoint.dir) at a larger filesystem, or "
            "set checkpoint.enabled = false."
        )
    if free < keep * size + MARGIN_BYTES:  # (after the start: also when not even one fits)
        log.warning(
            "checkpoint directory '%s' has %.1f MB free: room for %d checkpoint(s) of %.1f MB (%s), "
            "not checkpoint.keep = %d; a save that does not fit is skipped and retried at the next "
            "interval", root, free / 1e6, (free - MARGIN_BYTES) // size, size / 1e6, source, keep,
        )  # fmt: skip


def room_error(root: Path, size: int) -> OSError | None:
    """An ENOSPC error saying why a save of ``size`` bytes does not fit in ``root`` now, else None."""
    free = free_bytes(root)
    if free is None or free >= size + MARGIN_BYTES:
        return None
    return OSError(
        errno.ENOSPC,
        f"{os.strerror(errno.ENOSPC)}: {free / 1e6:.1f} MB free, a checkpoint takes {size / 1e6:.1f} MB "
        "(not started)",
    )
