"""Per-rank facts (host, devices, CPUs) and the rank -> node -> device map built from them.

Each rank describes itself with `local_rank_info`; the coordinator gathers those and calls
`build_topology`, a pure function, to number nodes and give each rank its device.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from rlinf_hpc.cluster.devices import GpuProbe, probe_gpus
from rlinf_hpc.cluster.environment import JobEnvironment
from rlinf_hpc.cluster.hetjob import read_het_layout


@dataclass(frozen=True)
class RankInfo:
    """What one rank knows about itself, sent to the coordinator at start-up."""

    rank: int
    hostname: str
    pid: int
    env_local_rank: int | None
    cpus: tuple[int, ...]
    gpus: GpuProbe = field(default_factory=lambda: GpuProbe(0))
    #: The heterogeneous SLURM job component of this rank (`cluster.hetjob`); None otherwise.
    het_group: int | None = None


@dataclass(frozen=True)
class RankSlot:
    """Where a rank sits: its node, its index on that node, and the device it should use."""

    rank: int
    hostname: str
    node_index: int
    local_rank: int
    device: str
    cpus: tuple[int, ...]
    num_visible_gpus: int
    het_group: int | None = None

    @property
    def has_gpu(self) -> bool:
        return self.device.startswith("cuda")


def local_rank_info(rank: int, environment: JobEnvironment) -> RankInfo:
    """Describe this process. Cheap: no torch import, NVML only."""
    try:
        cpus = tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        cpus = tuple(range(os.cpu_count() or 1))
    return RankInfo(
        rank=rank,
        hostname=socket.gethostname(),
        pid=os.getpid(),
        env_local_rank=environment.local_rank,
        cpus=cpus,
        gpus=probe_gpus(),
        het_group=_het_group(rank),
    )


def _het_group(rank: int) -> int | None:
    layout = read_het_layout()
    if layout is None or rank >= layout.total:
        return None
    return layout.group_of(rank)


def compress_cpus(cpus: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"``.

    >>> compress_cpus((0, 1, 2, 5, 7, 8))
    '0-2,5,7-8'
    """
    if not cpus:
        return "-"
    parts: list[str] = []
    start = prev = cpus[0]
    for cpu in list(cpus[1:]) + [None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if cpu is not None:
            start = prev = cpu
    return ",".join(parts)


def build_topology(infos: list[RankInfo]) -> list[RankSlot]:
    """Number nodes in order of first appearance and give each rank a device.

    A rank's local index comes from its launcher when known, else from its order among the
    ranks on the same host — also where the launcher's indices repeat on a host (the parts of a
    heterogeneous SLURM job on one machine each count from 0: two GPU ranks would take
    ``cuda:0``). With k visible GPUs it uses ``cuda:(local_rank % k)``.

    >>> infos = [RankInfo(r, "a" if r < 2 else "b", 100 + r, None, (0,)) for r in range(3)]
    >>> [(s.rank, s.node_index, s.local_rank, s.device) for s in build_topology(infos)]
    [(0, 0, 0, 'cpu'), (1, 0, 1, 'cpu'), (2, 1, 0, 'cpu')]
    >>> parts = [RankInfo(r, "a", 100 + r, r % 2, (0,)) for r in range(4)]
    >>> [s.local_rank for s in build_topology(parts)]  # two launcher nodes, one host
    [0, 1, 2, 3]
    """
    ordered = sorted(infos, key=lambda i: i.rank)
    given: dict[str, list[int]] = {}
    for info in ordered:
        if info.env_local_rank is not None:
            given.setdefault(info.hostname, []).append(info.env_local_rank)
    repeated = {host for host, ids in given.items() if len(set(ids)) < len(ids)}
    node_of: dict[str, int] = {}
    seen_on_node: dict[str, int] = {}
    slots = []
    for info in ordered:
        node_index = node_of.setdefault(info.hostname, len(node_of))
        order = seen_on_node.get(info.hostname, 0)
        seen_on_node[info.hostname] = order + 1
        own = info.env_local_rank is not None and info.hostname not in repeated
        local_rank = info.env_local_rank if own else order
        num_gpus = info.gpus.num_visible
        device = f"cuda:{local_rank % num_gpus}" if num_gpus else "cpu"
        slots.append(
            RankSlot(
                info.rank, info.hostname, node_index, local_rank, device, info.cpus, num_gpus, info.het_group
            )
        )
    return slots
