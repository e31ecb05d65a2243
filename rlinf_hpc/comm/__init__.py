"""Communication: control plane, data plane (structured P2P + collectives), group communicators.

Only this package touches MPI (and, later, NCCL/torch.distributed) handles directly.
"""

from rlinf_hpc.comm.collectives import CollectiveMismatchError
from rlinf_hpc.comm.control import COORDINATOR_RANK, ControlPlane
from rlinf_hpc.comm.dataplane import DataPlane
from rlinf_hpc.comm.directory import Address, ChannelSpec, Directory
from rlinf_hpc.comm.groups import GroupComm, create_group_comm, live_group_comms
from rlinf_hpc.comm.handles import WorkHandle, wait_all
from rlinf_hpc.comm.mpi import abort, finalize, library_version, world_rank, world_size
from rlinf_hpc.comm.sending import CommOptions
from rlinf_hpc.comm.waiting import Backoff, poll_until

__all__ = [
    "COORDINATOR_RANK",
    "Address",
    "Backoff",
    "ChannelSpec",
    "CollectiveMismatchError",
    "CommOptions",
    "DataPlane",
    "Directory",
    "WorkHandle",
    "wait_all",
    "ControlPlane",
    "GroupComm",
    "abort",
    "create_group_comm",
    "finalize",
    "library_version",
    "live_group_comms",
    "poll_until",
    "world_rank",
    "world_size",
]
