"""A helper process that names the rank that died first on rank 0's node.

A rank killed with ``kill -9`` takes the whole job down within milliseconds — MPI notices the
broken link on the next operation and ends the other ranks, and the launcher's message names
whichever process it saw exit first (often rank 0) — before any thread of the job can say who it
was. This helper is not an MPI rank and lives in a session of its own, so it outlives them: it
waits on each local rank's process (``pidfd``: woken at the exit, no polling) and the first one
to exit without having left the job (its heartbeat says ``left`` when it leaves normally) is
named — unless the job recorded its own culprit first — on stderr, in ``events.jsonl`` and in
``summary.json`` (``culprit``), with why where the node says: the kernel's OOM killer
(`rlinf_hpc.runtime.oomkill`; the culprit's ``cause`` and ``cause_detail``). Exits the helper
sees in one wake-up cannot be ordered (nor a watched rank it then finds a zombie: killed, its
threads still being torn down, its pidfd not yet ready, or SIGKILL pending): it names all of
them, as candidates (before, it named one: on a loaded 2-core box rank 0 or 1 for a killed rank
2, in about one run in three), those it saw exit apart from those it found ending. It raises
its own priority where it may, so that it usually wakes at the first exit alone — under mpiexec
Hydra's kills of the others land before it looks all the same. Ranks already dead when it
starts (late, under load) are such a wake-up too, and a watched rank that left a crash file is a
candidate before its exit shows: the file is written before the crashed process ends, and the
launcher may end the others first. It exits once it has named a culprit or every watched
process left normally. Rank 0 starts it once the placement is known; ranks on other
nodes are not watched by it.

    python -m rlinf_hpc.runtime.deathwatch RUN_DIR RUN_ID '{"2": 1234, ...}'
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from rlinf_hpc.runtime.accounting import claim_end, claimed_culprit
from rlinf_hpc.runtime.crashes import crash_cause, crash_file
from rlinf_hpc.runtime.heartbeat import HEARTBEATS, culprit_of, death_of, read_heartbeat, record_culprit
from rlinf_hpc.runtime.ownership import pid_alive

#: Written into RUN_DIR/heartbeats/ once the watch is on.
READY = "deathwatch.json"
#: One line per wake-up with exits, appended at once (before any naming): the order in which
#: this node's ranks exited, for the coordinator's own account when several are found dead
#: (over OFI a killed rank's peers abort within milliseconds of it; in rank order the first
#: peer was named).
EXITS = "exits.jsonl"


def _record_exits(run_dir: Path, ranks: list[int]) -> None:
    if not ranks:
        return
    line = json.dumps({"time": round(time.time(), 6), "ranks": ranks}) + "\n"
    with contextlib.suppress(OSError), (run_dir / HEARTBEATS / EXITS).open("a", encoding="utf-8") as out:
        out.write(line)


def exit_order(beats: Path) -> dict[int, int]:
    """``{rank: position}`` in the order the death watch saw this node's ranks exit (ranks of one
    wake-up share a position); {} when it saw none."""
    order: dict[int, int] = {}
    try:
        lines = (beats / EXITS).read_text(encoding="utf-8").splitlines()
    except OSError:
        return order
    for position, text in enumerate(lines):
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            for rank in json.loads(text).get("ranks", []):
                order.setdefault(int(rank), position)
    return order


def start(run_dir: Path, run_id: str, pids: dict[int, int]) -> subprocess.Popen[bytes] | None:
    """Start the helper for ``{rank: pid}`` of this node (None where pidfd is missing)."""
    if not hasattr(os, "pidfd_open") or not pids:
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "rlinf_hpc.runtime.deathwatch", str(run_dir), run_id, json.dumps(pids)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # not in the job's process group: it must outlive the ranks
    )


def watch(run_dir: Path, run_id: str, pids: dict[int, int]) -> None:
    with contextlib.suppress(OSError):  # wake before the launcher ends the others (root may)
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    # srun ends a step whose task died with SIGTERM to every process of the step, this one
    # included: it was gone before it could name the task (it ends by itself, see above)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    poller = select.poll()
    fds: dict[int, int] = {}
    gone: list[int] = []
    for rank, pid in pids.items():
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            gone.append(rank)  # dead before the watch began
            continue
        fds[fd] = rank
        poller.register(fd, select.POLLIN)
    (run_dir / HEARTBEATS / READY).write_text(json.dumps({"pid": os.getpid(), "ranks": sorted(fds.values())}))
    # ranks dead before the watch began count as its first wake-up: the rank whose death made
    # the launcher end them may still be tearing down (a segfaulted rank 1 whose exit came after
    # the coordinator's, the helper started late under load: the coordinator was named alone)
    woke = [rank for rank in gone if not _left(run_dir, rank)]
    first: list[int] = []
    seen_first: list[int] = []
    seen_at = time.time()
    while not first and (fds or woke):
        # exits seen in one wake-up cannot be ordered: all of them are named as candidates
        woke += _exits_ready(poller, fds, 0 if woke else 1000, run_dir)
        first, woke = sorted(woke), []  # the first wake-up's exits lead, in rank order
        _record_exits(run_dir, first)
        seen_first, seen_at = list(first), time.time()
        if first:  # a killed process whose threads are still being torn down is a zombie
            # already but not yet reported by its pidfd: a rank that saw it dead and exited at
            # once was seen first (a worker named for a killed rank 0, in CI under load)
            # — or not a zombie yet, still tearing down (a killed coordinator with its threads and
            # memory, while the workers that saw its sockets close had exited already: CI), or
            # killed and not yet run since (SIGKILL pending)
            exiting = [r for r in fds.values() if _exiting(pids[r]) and not _left(run_dir, r)]
            _record_exits(run_dir, exiting)
            first += exiting
            # a large process (the coordinator) can take longer to tear down than the small
            # ones that saw its sockets close: exits within the next moment count with these
            later = [r for r in _exits_ready(poller, fds, 300, run_dir) if r not in first]
            _record_exits(run_dir, later)
            first += later
    if first:  # in the order seen: the launcher ends the others only after the first exit
        _report(run_dir, run_id, first, pids, seen_first, seen_at)
    for fd in fds:  # the job ends with the culprit named: stop watching the rest
        os.close(fd)


def _exits_ready(poller: select.poll, fds: dict[int, int], timeout_ms: int, run_dir: Path) -> list[int]:
    """The watched ranks whose exit is ready within ``timeout_ms`` (their pidfds closed and no
    longer watched), less those that left the job normally."""
    ranks = []
    for fd, _ in poller.poll(timeout_ms):
        rank = fds.pop(fd)
        poller.unregister(fd)
        os.close(fd)
        if not _left(run_dir, rank):
            ranks.append(rank)
    return ranks


#: ``PF_EXITING`` in /proc/PID/stat's flags: the process has begun to exit.
_PF_EXITING = 0x4
#: SIGKILL's bit in /proc/PID/status's pending-signal masks.
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def _exiting(pid: int) -> bool:
    """The process is gone, a zombie, already exiting (one of its threads has ``PF_EXITING``:
    killed, its threads still being torn down, not a zombie yet and its pidfd not ready) or
    about to (SIGKILL pending: killed, and not run since — on a loaded box a killed process can
    wait that long)."""
    if not pid_alive(pid):
        return True
    with contextlib.suppress(OSError):
        if any(_task_exiting(Path(f"/proc/{pid}/task/{task}")) for task in os.listdir(f"/proc/{pid}/task")):
            return True
    return _task_exiting(Path(f"/proc/{pid}"))


def _task_exiting(proc: Path) -> bool:
    """The thread (or process) whose /proc directory is ``proc`` is exiting or has SIGKILL pending."""
    try:
        fields = (proc / "stat").read_text(encoding="ascii").rsplit(")", 1)[1].split()
        if int(fields[6]) & _PF_EXITING:  # fields from the state on: flags is the 7th
            return True
        status = (proc / "status").read_text(encoding="ascii").splitlines()
        masks = [line.split()[1] for line in status if line.startswith(("SigPnd:", "ShdPnd:"))]
        return any(int(mask, 16) & _SIGKILL_BIT for mask in masks)
    except (OSError, IndexError, ValueError):
        return False


def _written_by(beats: Path, rank: int, moment: float | None) -> bool:
    """Rank ``rank``'s crash file was last written at or before ``moment`` (None: any time)."""
    try:
        return moment is None or crash_file(beats, rank).stat().st_mtime <= moment
    except OSError:
        return False


def _left(run_dir: Path, rank: int) -> bool:
    """The rank said it left the job (a normal exit)."""
    return bool((read_heartbeat(run_dir / HEARTBEATS / f"rank-{rank}.json") or {}).get("left"))


def _report(
    run_dir: Path,
    run_id: str,
    ranks: list[int],
    pids: dict[int, int],
    seen_first: list[int],
    seen_at: float | None = None,
) -> None:
    """Name ``ranks[0]`` as the rank that died; the others exited in the same moment, so any
    of them may have been first: they are named with it (never a wrong culprit with certainty).
    ``ranks`` is in the order seen (``seen_first``: the exits of the first wake-up): a rank's
    pidfd is ready before its parent, the launcher, learns of the exit, so the launcher's kills
    of the others come after it. (Sorting them put rank 0 first: a killed rank 2 was reported as
    the coordinator having died, the worker only "in the same instant", in 3 of 3 runs.)"""
    if 0 not in ranks:  # the coordinator may still name a culprit itself (a failure it saw)
        time.sleep(2.0)  # — not once it is gone: srun then ends the step (this helper with it)
    summary = read_heartbeat(run_dir / "summary.json") or {}
    if summary.get("run_id") != run_id or claimed_culprit(run_dir, run_id) is not None:
        return  # another run's directory now, or this run's culprit was named already
    # a crash file is written before the crashed rank's exit, which the launcher or MPI may
    # answer by ending the others first (CI: the coordinator was named alone for a segfault of
    # rank 1, not yet seen exiting): a watched rank that crashed before the first exit the
    # watch saw (``seen_at``) is a candidate all the same — one that crashed after it may have
    # crashed because of it (a peer's library on a link that went dead) and is not
    beats = run_dir / HEARTBEATS
    crashed = [
        r for r in sorted(pids) if r not in ranks and crash_cause(beats, r) and _written_by(beats, r, seen_at)
    ]
    ranks = ranks + crashed
    host = socket.gethostname()
    records = {r: read_heartbeat(beats / f"rank-{r}.json") or {} for r in ranks}
    roles = {r: records[r].get("roles") or ("coordinator" if r == 0 else "no component") for r in ranks}
    doing = {r: records[r].get("activity") or "idle" for r in ranks}
    problems = [
        death_of(
            r,
            {**records[r], "roles": roles[r], "host": host, "pid": pids[r]},
            heartbeats=beats,
        )
        for r in ranks
    ]
    # a candidate that left evidence of its end (its crash file, the kernel's record of an OOM
    # kill) is the one: the others of that instant were ended because it died
    problem = next((p for p in problems if p.get("cause", {}).get("certain")), problems[0])
    rank = problem["rank"]
    others = [r for r in ranks if r != rank]
    why = "it exited without leaving the job (killed, or a crash below Python)"
    if problem.get("cause"):  # a crash below Python, the kernel's OOM killer
        why = problem["cause"]["detail"]
    if problem.get("cause", {}).get("certain"):
        others = []  # the kernel killed this one: the others exited because it did
    also = ""
    if others:  # those exited in the wake-up that saw it, then those found ending as it was seen
        short = {r: f"rank {r} ({roles[r]}, pid {pids[r]}, in {doing[r]})" for r in others}
        together = [short[r] for r in others if r in seen_first]
        after = [short[r] for r in others if r not in seen_first]
        parts = [f"in the same instant: {'; '.join(together)}"] if together else []
        if after:  # under mpiexec the launcher kills the others at the first exit, before this
            # looks — but under load a killed rank's own exit was seen after the coordinator's
            parts.append(f"already ending when it was seen: {'; '.join(after)}")
        also = f"; {'; '.join(parts)} — any of them may have been first"
    said = f"rank {rank} ({roles[rank]}) on {host}, pid {pids[rank]}, died while in {doing[rank]}"
    named = {"activity": doing[rank], "seen_first": list(seen_first)}
    if others:
        named["simultaneous"] = [{"rank": r, "component": roles[r]} for r in others]
    if not record_culprit(run_dir, {**problem, **named}):
        return  # the job named its culprit first: that account stands
    sys.stderr.write(f"rlinf-hpc: {said}: {why}{also}; the other ranks ended with it\n")
    sys.stderr.flush()
    culprit = culprit_of({**problem, **named})
    lines = [{"time": round(time.time(), 6), "rank": rank, "event": "rank_died", "culprit": culprit}]
    if 0 in ranks and claim_end(run_dir, run_id, "deathwatch"):  # the coordinator cannot write it
        lines.append({"time": round(time.time(), 6), "rank": 0, "event": "end", "outcome": "rank died",
                      "wall_seconds": None, "culprit": culprit})  # fmt: skip
    with contextlib.suppress(OSError), (run_dir / "events.jsonl").open("a", encoding="utf-8") as events:
        for line in lines:
            events.write(json.dumps({**line, "run_id": run_id}) + "\n")


if __name__ == "__main__":
    watch(Path(sys.argv[1]), sys.argv[2], {int(k): int(v) for k, v in json.loads(sys.argv[3]).items()})
