"""torch.distributed over one component group, for data-parallel training (DDP).

The rendezvous store is the group's MPI communicator itself (`GroupComm.torch_store`): no
TCPStore listens for the job's lifetime, no port is open to anyone who reaches the node. Every
member joins a process group of the group's size (gloo on CPU, NCCL on GPU). No
MASTER_ADDR/MASTER_PORT, no launcher variables: MPI already knows who is in the group.
One process group per process: a rank hosts at most one data-parallel component.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from rlinf_hpc.comm import GroupComm
from rlinf_hpc.comm.interfaces import pin_socket_interfaces

_store: Any = None


def init_group_process_group(
    group: GroupComm, device: str, timeout_s: float = 600.0, always: bool = False
) -> bool:
    """Join the group's process group (for a group of one only with ``always``, e.g. for
    DeepSpeed, which insists on one). True if one exists now."""
    global _store
    if group.size == 1 and not always:
        return False
    if dist.is_initialized():
        if dist.get_world_size() != group.size:
            raise RuntimeError(
                f"this rank is already in a torch.distributed group of {dist.get_world_size()}; "
                f"'{group.name}' needs one of {group.size} (one data-parallel component per rank; "
                "an in-process vLLM rollout engine on this rank starts a group of 1 of its own: "
                "give the rollout ranks of its own)"
            )
        return True
    timeout = datetime.timedelta(seconds=timeout_s)
    pin_socket_interfaces()
    _store = group.torch_store(timeout_s)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=_store, rank=group.rank, world_size=group.size, timeout=timeout)
    return True


def release_process_group() -> None:
    global _store
    if dist.is_initialized():
        dist.destroy_process_group()
    _store = None


def broadcast_parameters(model: torch.nn.Module, root: int = 0) -> None:
    """Make every member's parameters and buffers equal to ``root``'s."""
    if not dist.is_initialized():
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=root)


def wrap_data_parallel(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """DDP over the group's process group, or the model itself for a group of one.

    ``find_unused_parameters=True`` is there for exact resumes, not for unused parameters: it
    turns off DDP's one-time rebuild of its gradient buckets in the order of the first backward.
    With the rebuild, the first step after a resume reduces gradients laid out differently
    from an uninterrupted run (which rebuilt long before), and gloo's all-reduce over more
    than two ranks then rounds differently. Cost: one autograd-graph traversal per backward
    (and torch's one-time warning that no parameter was unused)."""
    if not dist.is_initialized():
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [torch.device(device).index or 0] if device.startswith("cuda") else None
    return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=True)
