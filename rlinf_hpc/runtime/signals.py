"""SIGINT/SIGTERM become a `JobInterrupted` exception in the rank's main thread.

Under mpiexec (Hydra) and srun the signal reaches every rank; each one unwinds through its
normal exit path (the coordinator stops the workers that are still there, workers say Bye), so
the job ends cleanly instead of leaving ranks behind.

SIGUSR2 (SLURM's ``--signal=B:USR2@SECONDS`` before the allocation ends, or ``scancel
--signal=USR2``) only sets a flag: the coordinator reads it at the next step boundary, saves a
checkpoint and stops, so that every rank saves the same step. SIGUSR1 is left to NCCL.
"""

from __future__ import annotations

import signal
from types import FrameType

from rlinf_hpc.errors import JobInterrupted

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: The "save and stop" signal.
STOP_SIGNAL = signal.SIGUSR2

_stop_requested: list[str] = []


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    # Ignore repeats while we unwind: a second Ctrl-C must not interrupt the clean exit.
    for sig in HANDLED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise JobInterrupted(signum)


def ignore_interrupts() -> None:
    """The rank is on its way out (its work ended, cleanly or not): a SIGINT/SIGTERM arriving
    now must not raise inside the cleanup. Under mpiexec a worker that the coordinator had
    already stopped got Hydra's forwarded SIGINT while closing its heartbeat, died with a
    traceback, and the job ended 131 instead of 130. Main thread only."""
    for sig in HANDLED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _flag_stop(signum: int, frame: FrameType | None) -> None:
    _stop_requested.append(signal.Signals(signum).name)


def stop_requested() -> str | None:
    """Why a save-and-stop was asked for on this rank (a signal's name, or what
    `request_stop` was given), else None."""
    return _stop_requested[0] if _stop_requested else None


def request_stop(reason: str) -> None:
    """Ask for the same save-and-stop as SIGUSR2 at the next step boundary (the memory-leak
    monitor's ``checkpoint_stop`` action)."""
    _stop_requested.append(reason)


def install_signal_handlers() -> None:
    """Make SIGINT/SIGTERM raise `JobInterrupted` and SIGUSR2 flag a save-and-stop (main
    thread only)."""
    for sig in HANDLED_SIGNALS:
        signal.signal(sig, _raise_interrupted)
    signal.signal(STOP_SIGNAL, _flag_stop)
