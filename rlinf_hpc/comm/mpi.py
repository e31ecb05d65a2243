"""The MPI world, imported lazily so that CLI commands that need no MPI start fast."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
from collections.abc import MutableMapping
from functools import cache
from pathlib import Path
from typing import Any

# UCX packs every network interface it can use into the address each rank sends at MPI_Init,
# loopback-only jobs included. On hosts whose NIC reports no link speed (virtual NICs: sysfs
# speed -1) the receiving rank intermittently rejects that address ("failed to unpack address,
# invalid bandwidth 0.00", pmodels/mpich#7417) and MPI_Init aborts. When every rank of the job
# is known to share one node, shared memory is all UCX needs, so that is what it is given
# unless the user chose transports themselves.
SINGLE_NODE_UCX_TLS = "self,sm"
# Set by `rlinf-hpc` in the environment of the ranks it starts under the venv's mpiexec.
LAUNCHED_MARK = "RLINF_HPC_LAUNCHED"


def _single_node_step(environ: MutableMapping[str, str]) -> bool:
    """True when the launcher says all ranks run on one node: an ``srun`` step on one node, or
    the venv's mpiexec started by rlinf-hpc outside SLURM (it then runs every rank locally)."""
    if environ.get("SLURM_STEP_NUM_NODES"):
        return environ["SLURM_STEP_NUM_NODES"] == "1"
    return environ.get(LAUNCHED_MARK) == "1" and not environ.get("SLURM_JOB_ID")


# Slurm's mpi/pmi2 plugin reads each PMI-1 request of a task with one read() of at most 1024
# bytes (src/plugins/mpi/pmi2/pmi1.c, "TODO: read until newline"; Slurm 22.05 here), and MPICH's
# PMI-1 client sends `put` lines of up to 1024 value characters plus the ~60 of the command, the
# kvsname and the key. Across nodes the bundled MPICH's UCX netmod puts a fixed ~4.5 KB business
# card per node (the UCX address, then uninitialised bytes) in 9 segments, run-length encoded, so
# their length follows the heap's contents (the command line and the environment among them):
# in some runs a segment's line passes 1024 and is cut in two — slurmstepd logs "value not
# properly terminated in client request", the KVS keeps a torn address and MPI_Init aborts in
# UCX's address unpack (`UCP_OBJECT_VERSION_V2`). OFI's card is 16 bytes a rank: no line comes
# near the limit. The user's own choice of netmod (either spelling) is kept.
PMI2_PLUGIN_NETMOD = "ofi"
NETMOD_VARIABLES = ("MPIR_CVAR_CH4_NETMOD", "MPICH_CH4_NETMOD")


def _multi_node_slurm_pmi2_step(environ: MutableMapping[str, str]) -> bool:
    """True in a task of an ``srun --mpi=pmi2`` step over more than one node (heterogeneous
    steps included: ``SLURM_STEP_NUM_NODES`` counts both parts' nodes)."""
    nodes = environ.get("SLURM_STEP_NUM_NODES", "")
    return (
        environ.get("SLURM_MPI_TYPE") == "pmi2" and "PMI_FD" in environ and nodes.isdigit() and int(nodes) > 1
    )


#: What `default_transports` set in this process's environment (for the job's start-up log).
TRANSPORT_DEFAULTS: dict[str, str] = {}


def default_transports(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Give UCX shared-memory transports on a single-node job unless ``UCX_TLS`` is set, and
    MPICH the OFI netmod in a multi-node step under Slurm's pmi2 plugin unless a netmod is set.
    Returns the variables it set."""
    chosen: dict[str, str] = {}
    if "UCX_TLS" not in environ and _single_node_step(environ):
        chosen["UCX_TLS"] = SINGLE_NODE_UCX_TLS
    netmod_set = any(name in environ for name in NETMOD_VARIABLES)
    if not netmod_set and _multi_node_slurm_pmi2_step(environ):
        chosen["MPIR_CVAR_CH4_NETMOD"] = PMI2_PLUGIN_NETMOD
    environ.update(chosen)
    return chosen


@cache
def mpi() -> Any:
    """The ``mpi4py.MPI`` module (initialises MPI on first use)."""
    import mpi4py

    from rlinf_hpc.comm.waiting import precise_sleeps, timer_slack_ns

    # Before MPI and any thread starts (threads inherit it): every wait here sleeps between polls.
    precise_sleeps(timer_slack_ns(os.environ))
    TRANSPORT_DEFAULTS.update(default_transports())

    # We finalize explicitly after the last message; errors return as exceptions.
    mpi4py.rc.errors = "exception"
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()  # every rank is past MPI_Init: every local rank has attached
    unlink_attached_segments()
    return MPI


#: The names MPICH gives the intranode shared-memory segments it creates in MPI_Init.
MPICH_SEGMENT = "/dev/shm/mpich_shm_"


def unlink_attached_segments(maps: str | None = None) -> list[str]:
    """Remove the names of the MPICH segments this process has mapped (not the memory).

    MPICH unlinks them in ``MPI_Finalize`` only, so every job that ended otherwise (a killed
    rank, an abort, the OOM killer) left one in /dev/shm — 2-5 MB of the node's RAM each, and
    a later job whose segment name collided attached to a stale one. Once every local rank has
    attached, the name is not needed any more (UCX removes its own segments' names the same
    way): the memory stays until the last process unmaps it, whichever way it ends. Returns the
    names removed here (another local rank may have been first)."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return []
    removed = []
    for path in mapped_segments(maps):
        with contextlib.suppress(FileNotFoundError, PermissionError):
            os.unlink(path)
            removed.append(path)
    return removed


def mapped_segments(maps: str) -> list[str]:
    """The MPICH segments in a /proc/PID/maps text that still have a name in /dev/shm."""
    found = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset device inode [path]
        path = fields[5] if len(fields) == 6 else ""
        if path.startswith(MPICH_SEGMENT) and not path.endswith("(deleted)") and path not in found:
            found.append(path)
    return found


def world() -> Any:
    """``MPI.COMM_WORLD``."""
    return mpi().COMM_WORLD


def world_rank() -> int:
    """This process's rank in ``COMM_WORLD``."""
    return int(world().Get_rank())


def world_size() -> int:
    """Number of ranks in ``COMM_WORLD``."""
    return int(world().Get_size())


def library_version() -> str:
    """First line of the MPI library's own version string, e.g. ``MPICH Version: 5.0.2``."""
    text = mpi().Get_library_version().strip().splitlines()[0]
    return " ".join(text.split())


def abort(exit_code: int, grace_s: float = 0.5) -> None:
    """End every rank of the job now. Used when an orderly shutdown is impossible.

    The reason was just logged: flush it and give the launcher ``grace_s`` to forward it, since
    Hydra's proxies stop reading a rank's pipes as soon as the abort reaches them (under load the
    last lines — the very ones that name the culprit — were lost)."""
    import contextlib
    import logging
    import sys
    import time

    for handler in logging.getLogger().handlers + logging.getLogger("rlinf_hpc").handlers:
        handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    time.sleep(grace_s)
    world().Abort(exit_code)
    # Under srun (PMI2) MPI_Abort only asks SLURM to end the step, and returns: a step that was
    # ending already (srun's SIGTERM after a task died) is not ended again, so this rank went on
    # running — into the SIGTERM's shutdown — until SLURM's KillWait (30 s) sent SIGKILL.
    os._exit(exit_code)


def finalize(within: float | None = None, stacks: Path | None = None) -> None:
    """Finalize MPI now (once every message is done), e.g. before this job requeues itself.

    ``within``: MPI_Finalize waits for every rank of the job (a PMI barrier), so a rank that
    left on a signal or a failure while another rank was dead waited there — in C, holding the
    GIL, its signals unanswered — until the launcher's SIGKILL (srun's KillWait: 30 s). Past
    ``within`` seconds this rank writes every thread's stack and exits with code 1: the timer
    is faulthandler's, a C thread (a Python timer thread never got the GIL back). The stacks go
    to ``stacks/finalize-rank-N.txt`` (the run directory's; stderr without it): on stderr,
    faulthandler's "Timeout (0:00:10)!" and a traceback read as a second failure, after the job
    had named its own."""
    MPI = mpi()
    if MPI.Is_finalized():
        return
    out, path = sys.stderr, None
    if within is not None and stacks is not None:
        rank = MPI.COMM_WORLD.Get_rank()
        path = stacks / f"finalize-rank-{rank}.txt"
        with contextlib.suppress(OSError):
            stacks.mkdir(parents=True, exist_ok=True)
            out = path.open("w", encoding="utf-8")
            out.write(
                f"# rank {rank} pid {os.getpid()}: MPI_Finalize did not return within {within:.0f} s "
                "(a rank of the job is gone or hung); it exited with code 1. Its stacks then:\n"
            )
            out.flush()
    if within is not None:
        sys.stderr.flush()
        faulthandler.dump_traceback_later(within, exit=True, file=out)
    MPI.Finalize()  # if the stack below ends here: a rank of the job is gone or hung
    if within is not None:
        faulthandler.cancel_dump_traceback_later()
        if out is not sys.stderr:
            out.close()
            with contextlib.suppress(OSError):
                assert path is not None
                path.unlink()  # it returned in time: nothing to tell
