"""Run named checks on every rank; a failure prints its traceback and aborts the whole job."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

from rlinf_hpc.comm.mpi import abort, world


def run_checks(checks: list[tuple[str, Callable[[], None]]], label: str, only_env: str) -> int:
    """Run ``checks`` in order on every rank (``$only_env`` may list a subset by name; a subset
    run ends with an ``ONLY [...] OK`` line instead of ``label``, and unknown names fail)."""
    comm = world()
    rank = comm.Get_rank()
    only = set(filter(None, os.environ.get(only_env, "").split(",")))
    unknown = only - {name for name, _ in checks}
    if unknown:
        if rank == 0:
            sys.stderr.write(f"${only_env} names unknown checks {sorted(unknown)}\n")
        comm.Barrier()  # the message is written before any rank aborts (which kills rank 0 too)
        abort(2)
    for name, check in checks:
        if only and name not in only:
            continue
        try:
            check()
            comm.Barrier()
        except BaseException:  # noqa: BLE001 - report and take every rank down: never hang
            sys.stderr.write(f"rank {rank}: check {name} FAILED\n{traceback.format_exc()}")
            abort(1)  # flushes and lets the launcher forward the traceback first
        if rank == 0:
            print(f"CHECK {name} ok", flush=True)
    if rank == 0:
        if only:  # never the full-run line: a partial run must not pass for a whole one
            print(f"ONLY {sorted(only)} (set by ${only_env}) OK on {comm.Get_size()} ranks", flush=True)
        else:
            print(f"{label} on {comm.Get_size()} ranks", flush=True)
    return 0
