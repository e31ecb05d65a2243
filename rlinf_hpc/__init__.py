"""rlinf_hpc: RL post-training as SLURM jobs of MPI ranks.

Rank 0 is the coordinator: it runs the user's macro flow (plain Python) and drives component
groups of worker ranks, each with its own MPI communicator. `init` gives any mpiexec/srun
script the data plane on its own (structured send/recv and collectives, no coordinator).
"""

from typing import Any

__version__ = "0.1.0"


def init(backend: str = "auto", comm: Any = None, verify: bool = False) -> Any:
    """The data plane for an existing MPI script; see `rlinf_hpc.comm.standalone.init`."""
    from rlinf_hpc.comm.standalone import init as _init

    return _init(backend, comm, verify)
