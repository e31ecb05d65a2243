"""Communication: the MPI world, the control plane, group communicators, non-spinning waits.

Only this package touches MPI (and, later, NCCL/torch.distributed) handles directly.
"""

from rlinf_hpc.comm.control import COORDINATOR_RANK, ControlPlane
from rlinf_hpc.comm.groups import GroupComm, create_group_comm, live_group_comms
from rlinf_hpc.comm.mpi import abort, library_version, world_rank, world_size
from rlinf_hpc.comm.waiting import Backoff, poll_until

__all__ = [
    "COORDINATOR_RANK",
    "Backoff",
    "ControlPlane",
    "GroupComm",
    "abort",
    "create_group_comm",
    "library_version",
    "live_group_comms",
    "poll_until",
    "world_rank",
    "world_size",
]
