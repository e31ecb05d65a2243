"""Non-spinning waits: back-off growth, the idle tier, and timeout messages."""

from __future__ import annotations

import time

import pytest
from test_cli import assert_user_error

from rlinf_hpc.comm import Backoff, poll_until
from rlinf_hpc.errors import CommTimeoutError

from conftest import BIN, CONFIGS, job_env, rlinf, run_command


def test_backoff_doubles_to_cap_then_rises_to_idle_cap_after_idle_time() -> None:
    backoff = Backoff(initial=1e-4, maximum=4e-4, idle_after=0.05, idle_maximum=1.6e-3)
    assert [backoff.next_delay() for _ in range(4)] == [1e-4, 2e-4, 4e-4, 4e-4]
    time.sleep(0.06)
    delays = [backoff.next_delay() for _ in range(4)]
    assert delays == [4e-4, 8e-4, 1.6e-3, 1.6e-3]
    backoff.reset()
    assert backoff.next_delay() == 1e-4


def test_poll_until_returns_first_non_none() -> None:
    values = iter([None, None, 0, 5])
    assert poll_until(lambda: next(values), timeout=5, describe=lambda: "x") == 0


def test_poll_until_timeout_names_the_wait() -> None:
    start = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"rank 3 waited for rank 1 on recv: no answer after 0\.2 s"):
        poll_until(lambda: None, timeout=0.2, describe=lambda: "rank 3 waited for rank 1 on recv")
    assert 0.2 <= time.monotonic() - start < 1.0


def test_poll_until_sleeps_instead_of_spinning() -> None:
    calls = 0

    def poll() -> None:
        nonlocal calls
        calls += 1

    cpu = time.process_time()
    with pytest.raises(CommTimeoutError):
        poll_until(poll, timeout=0.5, describe=lambda: "idle")
    # A spinning loop would make ~10^5+ calls and burn the whole 0.5 s of CPU.
    assert calls < 1000
    assert time.process_time() - cpu < 0.2


class _FakeComm:
    """A communicator that records the calls a `GroupComm` makes on it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.calls: list[str] = []

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
        return 0

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def Ibarrier(self):  # noqa: N802, ANN201
        self.calls.append("Ibarrier")
        return type("Request", (), {"Test": lambda self: True})()

    def allgather(self, obj: object) -> list[object]:
        self.calls.append("allgather")
        return [obj] * self.size

    def allreduce(self, obj: object) -> object:
        self.calls.append("allreduce")
        return obj

    def bcast(self, obj: object, root: int = 0) -> object:
        self.calls.append("bcast")
        return obj


def test_group_object_collectives_do_not_busy_poll_for_late_members() -> None:
    """A group of one returns its own objects without a pickling round trip; a larger group
    meets in the polled barrier before MPI's blocking (core-spinning) collective."""
    from rlinf_hpc.comm.groups import GroupComm

    solo_comm = _FakeComm(1)
    solo = GroupComm("solo", [3], solo_comm)
    batch = [{"ids": [1, 2]}]
    assert solo.allgather(batch)[0] is batch and solo.allreduce(batch) is batch and solo.bcast(batch) is batch
    assert solo_comm.calls == []
    pair_comm = _FakeComm(2)
    pair = GroupComm("pair", [3, 4], pair_comm)
    assert pair.allgather(5) == [5, 5] and pair.allreduce(5) == 5 and pair.bcast(5) == 5
    assert pair_comm.calls == ["Ibarrier", "allgather", "Ibarrier", "allreduce", "Ibarrier", "bcast"]
    for group in (solo, pair):
        group._comm = type("Freed", (), {"Free": lambda self: None})()  # noqa: SLF001
        group.free()


def test_a_rank_sleeps_with_a_one_microsecond_timer_slack_and_its_threads_too() -> None:
    """Joining MPI sets the timer slack (the kernel's 50 us default made a 20 us sleep between
    polls take 75 us); threads started later inherit it; RLINF_HPC_TIMER_SLACK_NS overrides."""
    script = (
        "import ctypes, threading\n"
        "from rlinf_hpc.comm.mpi import mpi\n"
        "mpi()\n"
        "seen = []\n"
        "thread = threading.Thread(target=lambda: seen.append(ctypes.CDLL(None).prctl(30, 0, 0, 0, 0)))\n"
        "thread.start(); thread.join()\n"
        "print(open('/proc/self/timerslack_ns').read().strip(), seen[0])\n"
    )
    result = run_command([str(BIN / "python"), "-c", script], timeout=60, env=job_env())
    assert result.returncode == 0, result.output
    assert result.stdout.split() == ["1000", "1000"]
    result = run_command(
        [str(BIN / "python"), "-c", script], timeout=60, env=job_env({"RLINF_HPC_TIMER_SLACK_NS": "50000"})
    )
    assert result.stdout.split() == ["50000", "50000"], result.output


@pytest.mark.parametrize("value", ["abc", "0", "-5", "1.5"])
def test_a_bad_timer_slack_is_refused_before_launch(value: str) -> None:
    result = rlinf("run", str(CONFIGS / "hello.toml"), env=job_env({"RLINF_HPC_TIMER_SLACK_NS": value}))
    assert_user_error(result, f"RLINF_HPC_TIMER_SLACK_NS={value!r} is not a positive whole number", "50000")
