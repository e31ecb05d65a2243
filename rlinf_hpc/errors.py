"""Exception types shared by every layer.

`UserError` is for mistakes a user can fix (bad config, too few ranks, broken environment): the
CLI prints its message in one paragraph and exits with code 2, without a traceback unless
``--debug``. Internal bugs keep ordinary exceptions and their tracebacks.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2


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


class CommTimeoutError(TimeoutError):
    """A wait on other ranks expired. The message names who waited for whom, on what, how long."""
