"""Run named checks on every rank; a failure prints its traceback and aborts the whole job."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

from rlinf_hpc.comm.mpi import world


def run_checks(checks: list[tuple[str, Callable[[], None]]], label: str, only_env: str) -> int:
    """Run ``checks`` in order on every rank (``$only_env`` may list a subset by name)."""
    comm = world()
    rank = comm.Get_rank()
    only = set(filter(None, os.environ.get(only_env, "").split(",")))
    for name, check in checks:
        if only and name not in only:
            continue
        try:
            check()
            comm.Barrier()
        except BaseException:  # noqa: BLE001 - report and take every rank down: never hang
            sys.stderr.write(f"rank {rank}: check {name} FAILED\n{traceback.format_exc()}")
            sys.stderr.flush()
            comm.Abort(1)
        if rank == 0:
            print(f"CHECK {name} ok", flush=True)
    if rank == 0:
        print(f"{label} on {comm.Get_size()} ranks", flush=True)
    return 0
