"""SIGINT/SIGTERM become a `JobInterrupted` exception in the rank's main thread.

Under mpiexec (Hydra) and srun the signal reaches every rank; each one unwinds through its
normal exit path (the coordinator stops the workers that are still there, workers say Bye), so
the job ends cleanly instead of leaving ranks behind.
"""

from __future__ import annotations

import signal
from types import FrameType

from rlinf_hpc.errors import JobInterrupted

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    # Ignore repeats while we unwind: a second Ctrl-C must not interrupt the clean exit.
    for sig in HANDLED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise JobInterrupted(signum)


def install_signal_handlers() -> None:
    """Make SIGINT/SIGTERM raise `JobInterrupted` (main thread only)."""
    for sig in HANDLED_SIGNALS:
        signal.signal(sig, _raise_interrupted)
