"""Per-step training metrics: one JSON line per step in ``RUN_DIR/metrics.jsonl`` and, when
asked, TensorBoard scalars in ``RUN_DIR/tensorboard`` (numbers only; nested dicts flattened as
``phases_s/rollout``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlinf_hpc.errors import UserError
from rlinf_hpc.runtime.disk import AppendFile


def tensorboard_available() -> bool:
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return False
    return True


def require_tensorboard() -> None:
    if not tensorboard_available():
        raise UserError(
            "grpo.tensorboard = true but the tensorboard package is not installed; "
            "`pip install tensorboard` (or the `dev` extra), or set grpo.tensorboard = false."
        )


def _scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out |= _scalars(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = float(value)
    return out


class MetricsLog:
    """Write step records; a no-op without a run directory.

    ``resume_after``: continue a run resumed from the checkpoint of that step — the records of
    later steps (written after the checkpoint by the run that stopped) are dropped from
    ``metrics.jsonl``, and TensorBoard purges its events from the next step on, so neither file
    has gaps or duplicates.
    """

    def __init__(
        self, run_dir: Path | None, tensorboard: bool = False, resume_after: int | None = None
    ) -> None:
        self._file: AppendFile | None = None
        if run_dir is not None:
            path = run_dir / "metrics.jsonl"
            kept = _records_up_to(path, resume_after) if resume_after is not None else []
            self._file = AppendFile(path, truncate=True)  # held while the disk is full
            self._file.write("".join(kept))
        self._writer: Any = None
        if tensorboard and run_dir is not None:
            require_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_after is None else resume_after + 1
            self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)

    def write(self, step: int, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
        if self._writer is not None:
            for name, value in _scalars(record).items():
                if name != "step":
                    self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._writer is not None:
            self._writer.close()


def _records_up_to(path: Path, step: int) -> list[str]:
    """The lines of ``path`` whose record's ``step`` is at most ``step`` (complete lines only)."""
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the kill
        if line.endswith("\n") and record.get("step", 0) <= step:
            kept.append(line)
    return kept
