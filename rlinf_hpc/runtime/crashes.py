"""A rank that crashes below Python (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT: a C extension, a
CUDA or NCCL library, a simulator) leaves its stacks where the job's watches find them.

Python prints nothing on such a crash unless `faulthandler` is on, and the launcher ends the
other ranks within milliseconds, so the job said "died ... (killed, or a crash below Python)"
and the user could not tell a segfault from ``kill -9``. `record_crashes` turns faulthandler on
into ``RUN_DIR/heartbeats/rank-N.crash`` (every thread's stack; faulthandler then re-raises the
signal, so the exit and any handler installed before it, UCX's for one, are unchanged), and
`crash_cause` reads it back for the death report — on rank 0's node (the death watch, the
watchdog) and, through a shared run directory, for ranks on other nodes (the watchdog sees the
file before the rank's death reaches it). An empty file is removed when the rank leaves.
"""

from __future__ import annotations

import contextlib
import faulthandler
import re
import sys
from pathlib import Path
from typing import IO, Any

#: The frame lines of a faulthandler dump: '  File "x.py", line 3 in f'
_FRAME = re.compile(r'\s+File "(.*)", line (\d+) in (\S+)')


def crash_file(heartbeats: Path, rank: int) -> Path:
    return heartbeats / f"rank-{rank}.crash"


class CrashRecorder:
    """faulthandler into this rank's crash file while it is in the job; stderr afterwards."""

    def __init__(self, heartbeats: Path, rank: int) -> None:
        self.path = crash_file(heartbeats, rank)
        self._file: IO[str] | None = None
        try:
            self._file = self.path.open("w", encoding="utf-8")
        except OSError:
            faulthandler.enable(all_threads=True)  # stderr, at least
            return
        faulthandler.enable(file=self._file, all_threads=True)

    def close(self) -> None:
        """The rank leaves the job normally: crashes after this go to stderr."""
        faulthandler.enable(file=sys.stderr, all_threads=True)
        if self._file is None:
            return
        self._file.close()
        with contextlib.suppress(OSError):
            if self.path.stat().st_size == 0:
                self.path.unlink()


def crash_cause(heartbeats: Path, rank: int) -> dict[str, Any] | None:
    """``{"kind": "crash", "detail", "certain": True}`` if rank ``rank`` crashed below Python."""
    path = crash_file(heartbeats, rank)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    error = lines[0].strip()  # "Fatal Python error: Segmentation fault"
    # the crashing thread's section ("Current thread ...", most recent call first; the other
    # threads' sections come before it)
    current = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), -1)
    frames = []
    for line in lines[current + 1 :]:
        found = _FRAME.match(line)
        if found is None:
            break
        frames.append(f"{found.group(3)} ({found.group(1)}:{found.group(2)})")
    where = f", in {' <- '.join(frames[:3])}" if frames else ""
    return {
        "kind": "crash",
        "detail": f"it crashed below Python: {error}{where} (every thread's stack: {path})",
        "certain": True,
    }
