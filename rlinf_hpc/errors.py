"""Exception types shared by every layer.

`UserError` is for mistakes a user can fix (bad config, too few ranks, broken environment): the
CLI prints its message in one paragraph and exits with code 2, without a traceback unless
``--debug``. Internal bugs keep ordinary exceptions and their tracebacks.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2
#: A checkpoint was saved and the job stopped (signal or allocation deadline); resume with
#: ``--resume auto`` (the default when the run directory holds checkpoints).
EXIT_SAVED_AND_STOPPED = 3
#: As 3, and the job requeued itself in SLURM (``scontrol requeue``).
EXIT_REQUEUED = 4
#: The job stopped without requeueing: a requeued run made no progress since the last one,
#: or the requeue limit for timeouts (``checkpoint.max_requeues``) is reached.
EXIT_NO_PROGRESS = 5


class UserError(Exception):
    """A problem the user can fix. The message says what, why and how to fix it."""

    exit_code = EXIT_USER_ERROR


class JobInterrupted(BaseException):
    """Raised in the main thread of a rank when it receives SIGINT or SIGTERM.

    A BaseException so that user code's ``except Exception`` does not swallow it.
    """

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        super().__init__(f"received {self.signal_name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class WorkerError(RuntimeError):
    """A worker raised while executing a command sent by the coordinator.

    Carries the failing world rank, its component, the method and the remote traceback.
    """

    def __init__(self, rank: int, component: str, method: str, error: str, traceback: str) -> None:
        self.rank = rank
        self.component = component
        self.method = method
        self.error = error
        self.remote_traceback = traceback
        super().__init__(f"rank {rank} (component '{component}') failed in {method}: {error}")


class WorkerInterrupted(WorkerError):
    """A worker left the job because it received SIGINT/SIGTERM: the launcher is ending the
    job (srun ends every task of a step after one died, Hydra forwards Ctrl-C), so the worker
    is not the culprit. Its signal's number gives the job's exit code, as `JobInterrupted`'s."""

    def __init__(self, rank: int, component: str, signal_name: str) -> None:
        import signal

        self.signal_name = signal_name
        self.signum = int(signal.Signals[signal_name])
        super().__init__(rank, component, "its service loop", signal_name, "")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class CommTimeoutError(TimeoutError):
    """A wait on other ranks expired. The message names who waited for whom, on what, how long."""


class CheckpointStop(Exception):
    """Raised by the checkpoint manager on rank 0 after it saved because the job must stop
    (SIGUSR2, the allocation deadline). The job runner ends every rank and may requeue."""

    def __init__(self, reason: str, step: int, path: str, progressed: bool) -> None:
        self.reason = reason
        self.step = step
        self.path = path
        self.progressed = progressed
        super().__init__(f"stopped after saving step {step} ({reason}) to {path}")
