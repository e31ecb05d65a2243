"""`rlinf-hpc info`: job environment, MPI library, ranks, devices and NVML status."""

from __future__ import annotations

import platform

from rlinf_hpc.cluster import build_topology, compress_cpus, detect_environment, local_rank_info
from rlinf_hpc.comm import ControlPlane, library_version
from rlinf_hpc.log import setup_logging
from rlinf_hpc.runtime.console import print_table


def run_info() -> int:
    """Every rank describes itself; rank 0 prints one table."""
    environment = detect_environment()
    setup_logging(environment.rank if environment.rank is not None else "?", "info")
    control = ControlPlane()
    environment.check_against_mpi(control.rank, control.size)
    setup_logging(control.rank, "info")
    infos = control.gather_to_coordinator(local_rank_info(control.rank, environment))
    if control.rank != 0:
        return 0
    assert infos is not None
    import rlinf_hpc

    slots = build_topology(infos)
    header = (
        f"rlinf_hpc {rlinf_hpc.__version__} | Python {platform.python_version()} | "
        f"{library_version()}\n"
        f"job environment: {environment.describe()}\n"
        f"ranks: {control.size} on {len({s.hostname for s in slots})} node(s)\n"
    )
    print(header, end="", flush=True)
    rows = [
        (
            str(slot.rank),
            slot.hostname,
            str(slot.node_index),
            str(slot.local_rank),
            slot.device,
            ", ".join(info.gpus.names) or "-",
            compress_cpus(slot.cpus),
            info.gpus.nvml_status,
        )
        for slot, info in zip(slots, sorted(infos, key=lambda i: i.rank), strict=True)
    ]
    print_table(
        "ranks",
        ["rank", "host", "node", "local rank", "device", "GPUs", "cpus", "NVML"],
        rows,
    )
    return 0
