"""JSON-lines event stream: one object per line, written as it comes (held while the disk is
full: `disk.AppendFile`)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from rlinf_hpc.runtime.disk import AppendFile


class EventLog:
    """Append events to ``path`` (``events.jsonl`` in the run directory; every line carries the
    run id, as a reused directory holds several runs); a no-op without one."""

    def __init__(self, path: Path | None, rank: int, run_id: str | None = None) -> None:
        self.path = path
        self.rank = rank
        self.run_id = run_id
        self._file: AppendFile | None = None
        self._lock = threading.Lock()  # the watchdog thread writes too
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = AppendFile(path)

    def write(self, event: str, **fields: Any) -> None:
        """Append one event with this rank and a timestamp."""
        if self._file is None:
            return
        record = {"time": round(time.time(), 6), "rank": self.rank, "event": event, **fields}
        if self.run_id is not None:
            record["run_id"] = self.run_id
        with self._lock:
            if self._file is not None:
                self._file.write(json.dumps(record, default=str) + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
