"""A helper process that names the rank that died first on rank 0's node.

A rank killed with ``kill -9`` takes the whole job down within milliseconds — MPI notices the
broken link on the next operation and ends the other ranks, and the launcher's message names
whichever process it saw exit first (often rank 0) — before any thread of the job can say who it
was. This helper is not an MPI rank and lives in a session of its own, so it outlives them: it
waits on each local rank's process (``pidfd``: woken at the exit, no polling) and the first one
to exit without having left the job (its heartbeat says ``left`` when it leaves normally) is
named — unless the job recorded its own culprit first — on stderr, in ``events.jsonl`` and in
``summary.json`` (``culprit``). It exits when every watched process is gone. Rank 0 starts it
once the placement is known; ranks on other nodes are not watched by it.

    python -m rlinf_hpc.runtime.deathwatch RUN_DIR RUN_ID '{"2": 1234, ...}'
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

from rlinf_hpc.runtime.watchdog import HEARTBEATS, read_heartbeat, record_culprit

#: Written into RUN_DIR/heartbeats/ once the watch is on.
READY = "deathwatch.json"


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
    named = False
    for rank in gone:
        record = read_heartbeat(run_dir / HEARTBEATS / f"rank-{rank}.json") or {}
        if not named and not record.get("left"):
            named = True
            _report(run_dir, run_id, rank, pids[rank], record)
    while fds:
        for fd, _ in poller.poll(1000):
            rank = fds.pop(fd)
            poller.unregister(fd)
            os.close(fd)
            record = read_heartbeat(run_dir / HEARTBEATS / f"rank-{rank}.json") or {}
            if named or record.get("left"):
                continue
            named = True
            _report(run_dir, run_id, rank, pids[rank], record)


def _report(run_dir: Path, run_id: str, rank: int, pid: int, record: dict) -> None:
    time.sleep(2.0)  # the job may still name a culprit itself (a failure it saw, an abort)
    summary = read_heartbeat(run_dir / "summary.json") or {}
    if summary.get("run_id") != run_id or summary.get("culprit") or summary.get("outcome") != "running":
        return  # another run's directory now, or this run ended with its own account
    roles = record.get("roles") or ("coordinator" if rank == 0 else "no component")
    doing = record.get("activity") or "idle"
    host = socket.gethostname()
    sys.stderr.write(
        f"rlinf-hpc: rank {rank} ({roles}) on {host}, pid {pid}, died while in {doing}: it exited "
        "without leaving the job (killed, or a crash below Python); the other ranks ended with it\n"
    )
    sys.stderr.flush()
    culprit = {"rank": rank, "component": roles, "host": host, "error": "died", "activity": doing}
    line = {
        "time": round(time.time(), 6),
        "rank": rank,
        "event": "rank_died",
        "culprit": culprit,
        "run_id": run_id,
    }
    try:
        with (run_dir / "events.jsonl").open("a", encoding="utf-8") as events:
            events.write(json.dumps(line) + "\n")
        record_culprit(run_dir, {"rank": rank, "kind": "died", "record": {**record, "roles": roles}})
    except OSError:
        pass


if __name__ == "__main__":
    watch(Path(sys.argv[1]), sys.argv[2], {int(k): int(v) for k, v in json.loads(sys.argv[3]).items()})
