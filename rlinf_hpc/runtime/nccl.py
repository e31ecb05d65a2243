"""NCCL's own failure reports, kept in the run directory and read by rank 0's watch.

`configure` sets, on every rank before any process group exists (a user's own values win):

- ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``: a failed or timed-out NCCL operation tears the process
  down (its rank is then named by the death watch) instead of hanging the job;
- ``TORCH_NCCL_TRACE_BUFFER_SIZE=2000``, ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``,
  ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE=RUN_DIR/nccl/trace_rank_``: torch's flight recorder dumps
  the last collectives of every rank on a timeout (``python -m torch.distributed.flight_recorder``
  reads them: which rank is missing from which collective);
- ``NCCL_DEBUG=WARN``, ``NCCL_DEBUG_FILE=RUN_DIR/nccl/nccl.%h.%p.log``: NCCL's warnings, one file
  per process (host and pid in the name).

`NcclLogWatch` reads the new ``NCCL WARN`` lines of those files (rank 0's watchdog thread, every
interval) and names the rank that wrote each (its pid through the heartbeats).

>>> parse_log_name("nccl.node7.4242.log")
('node7', 4242)
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

NCCL_DIR = "nccl"
_LOG_NAME = re.compile(r"^nccl\.(?P<host>.+)\.(?P<pid>\d+)\.log$")
_MAX_LINES_PER_SCAN = 20


def settings(run_dir: Path) -> dict[str, str]:
    directory = run_dir / NCCL_DIR
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(directory / "trace_rank_"),
        "NCCL_DEBUG": "WARN",
        "NCCL_DEBUG_FILE": str(directory / "nccl.%h.%p.log"),
    }


def configure(run_dir: Path, env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the NCCL variables this rank lacks; returns the ones set."""
    env = os.environ if env is None else env
    wanted = settings(run_dir)
    try:
        (run_dir / NCCL_DIR).mkdir(parents=True, exist_ok=True)
    except OSError:  # a node that does not see the run directory: no files, the rest still
        wanted = {k: v for k, v in wanted.items() if k in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_DEBUG")}
    added = {k: v for k, v in wanted.items() if k not in env}
    env.update(added)
    return added


def parse_log_name(name: str) -> tuple[str, int] | None:
    match = _LOG_NAME.match(name)
    return (match["host"], int(match["pid"])) if match else None


class NcclLogWatch:
    """``scan()`` -> the ``NCCL WARN`` lines written since the last scan, with who wrote them."""

    def __init__(self, run_dir: Path, rank_of: Callable[[str, int], int | None]) -> None:
        self.directory = run_dir / NCCL_DIR
        self.rank_of = rank_of  # (host, pid) -> rank, from the heartbeats
        self._offsets: dict[Path, int] = {}

    def scan(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        if not self.directory.is_dir():
            return found
        for path in sorted(self.directory.glob("nccl.*.log")):
            who = parse_log_name(path.name)
            if who is None:
                continue
            offset = self._offsets.get(path, 0)
            try:
                with path.open("rb") as file:
                    file.seek(offset)
                    chunk = file.read()
            except OSError:
                continue
            end = chunk.rfind(b"\n") + 1  # whole lines only; the rest at the next scan
            self._offsets[path] = offset + end
            for raw in chunk[:end].splitlines():
                line = raw.decode("utf-8", "replace").strip()
                if "NCCL WARN" in line and len(found) < _MAX_LINES_PER_SCAN:
                    host, pid = who
                    found.append({"host": host, "pid": pid, "rank": self.rank_of(host, pid), "line": line})
        return found
