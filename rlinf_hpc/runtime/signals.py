"""SIGINT/SIGTERM become a `JobInterrupted` exception in the rank's main thread.

Under mpiexec (Hydra) and srun the signal reaches every rank; each one unwinds through its
normal exit path (the coordinator stops the workers that are still there, workers say Bye), so
the job ends cleanly instead of leaving ranks behind.

SIGUSR2 (SLURM's ``--signal=B:USR2@SECONDS`` before the allocation ends, or ``scancel
--signal=USR2``) only sets a flag: the coordinator reads it at the next step boundary, saves a
checkpoint and stops, so that every rank saves the same step. SIGUSR1 is left to NCCL.

With ``checkpoint.sigterm_save_s`` (`defer_sigterm`) a first SIGTERM — ``scancel``, or the notice
of a preemption on a cluster that does not send the job's own signal — is a save-and-stop like
SIGUSR2 when the next step boundary comes within that many seconds: the coordinator flags it and
every rank goes on; past the grace (a timer: SIGALRM) it raises as without it. A second SIGTERM,
or a rank of the coordinator's node found dead (srun's SIGTERM after a task died), raises at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from rlinf_hpc.errors import JobInterrupted
from rlinf_hpc.log import get_logger

log = get_logger("signals")

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: The "save and stop" signal.
STOP_SIGNAL = signal.SIGUSR2

_stop_requested: list[str] = []
#: Set once the rank is on its way out (`ignore_interrupts`): a signal adds nothing then.
_leaving: list[bool] = []

#: Seconds a worker waits past the coordinator's grace before it raises by itself (the
#: coordinator's own expiry stops the workers, waiting `Coordinator.shutdown`'s 5 s for them).
WORKER_GRACE_MARGIN_S = 10.0

#: `defer_sigterm`'s settings: the grace, whether this rank saves (the coordinator), the check
#: that ends the deferral at once, and whether a SIGTERM is being deferred now.
_deferral: dict[str, Any] = {"grace_s": 0.0, "coordinator": False, "dead": None, "pending": False}


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    # Ignore repeats while we unwind: a second Ctrl-C must not interrupt the clean exit.
    for sig in HANDLED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    _cancel_grace()
    raise JobInterrupted(signum)


def _cancel_grace() -> None:
    """A deferred SIGTERM's timer must not fire into the exit that follows."""
    if _deferral["pending"]:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_IGN)


def ignore_interrupts() -> None:
    """The rank is on its way out (its work ended, cleanly or not): a SIGINT/SIGTERM arriving
    now must not raise inside the cleanup. Under mpiexec a worker that the coordinator had
    already stopped got Hydra's forwarded SIGINT while closing its heartbeat, died with a
    traceback, and the job ended 131 instead of 130. Main thread only."""
    _leaving.append(True)
    for sig in HANDLED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    _cancel_grace()


def _unraisable(args: Any) -> None:
    """A signal whose handler ran inside a finaliser (mpi4py's ``Group.__del__`` during garbage
    collection) raised where Python can only print "Exception ignored in ..." and drop it: the
    rank would go on as if no signal had come. Deliver it again, outside the finaliser; on the
    way out it is dropped without a traceback, like any signal then."""
    if not isinstance(args.exc_value, JobInterrupted):
        _previous_unraisable(args)
        return
    if not _leaving:  # sent from another thread: handled once this hook has returned
        signum = args.exc_value.signum
        signal.signal(signum, _raise_interrupted)
        threading.Timer(0.001, os.kill, (os.getpid(), signum)).start()


_previous_unraisable = sys.unraisablehook


def defer_sigterm(grace_s: float, coordinator: bool, dead: Callable[[], bool] | None = None) -> None:
    """A first SIGTERM becomes a save-and-stop at the next step boundary if that comes within
    ``grace_s`` seconds (see the module's docstring; 0: off). ``coordinator``: this rank flags
    the stop (a worker only waits, ``WORKER_GRACE_MARGIN_S`` longer); ``dead``: whether ranks of
    this node died (then the SIGTERM raises at once, so that they are named). Main thread only;
    the coordinator calls it again once its watchdog is up, to give ``dead``."""
    if grace_s <= 0:
        return
    _deferral.update(grace_s=grace_s, coordinator=coordinator, dead=dead)
    signal.signal(signal.SIGTERM, _defer)


def _defer(signum: int, frame: FrameType | None) -> None:
    if _deferral["pending"] or _any_dead(_deferral["dead"]):
        _raise_interrupted(signum, frame)  # a second SIGTERM, or a rank that died: stop now
    _deferral["pending"] = True
    grace = _deferral["grace_s"] + (0.0 if _deferral["coordinator"] else WORKER_GRACE_MARGIN_S)
    if _deferral["coordinator"]:
        _stop_requested.append("SIGTERM")
    signal.signal(signal.SIGALRM, _grace_over)
    signal.setitimer(signal.ITIMER_REAL, grace)
    log.warning(
        "received SIGTERM: %s within %g s, else stopping as without checkpoint.sigterm_save_s "
        "(a second SIGTERM stops at once)",
        "saving the next step boundary" if _deferral["coordinator"] else "going on to the coordinator's save",
        grace,
    )  # fmt: skip


def _any_dead(dead: Callable[[], bool] | None) -> bool:
    """``dead()``, False where it cannot tell (a handler must not raise anything else)."""
    try:
        return dead is not None and bool(dead())
    except Exception:  # noqa: BLE001 - unreadable heartbeats: defer as asked
        return False


def _grace_over(signum: int, frame: FrameType | None) -> None:
    _raise_interrupted(signal.SIGTERM, frame)


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
    sys.unraisablehook = _unraisable
