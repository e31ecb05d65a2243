"""The job environment (SLURM / mpiexec / singleton) and the rank -> node -> device map.

Only this package reads SLURM_*, PMI_* and OMPI_* variables.
"""

from rlinf_hpc.cluster.devices import GpuProbe, probe_gpus
from rlinf_hpc.cluster.environment import JobEnvironment, detect_environment
from rlinf_hpc.cluster.topology import RankInfo, RankSlot, build_topology, compress_cpus, local_rank_info

__all__ = [
    "GpuProbe",
    "JobEnvironment",
    "RankInfo",
    "RankSlot",
    "build_topology",
    "compress_cpus",
    "detect_environment",
    "local_rank_info",
    "probe_gpus",
]
