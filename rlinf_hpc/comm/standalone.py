"""`rlinf_hpc.init()`: the data plane inside any mpiexec/srun-started script, no coordinator.

>>> import rlinf_hpc                                      # doctest: +SKIP
>>> comm = rlinf_hpc.init()                               # doctest: +SKIP
>>> if comm.rank == 0:                                    # doctest: +SKIP
...     comm.send({"w": torch.randn(1024), "step": 3}, 1)
... elif comm.rank == 1:
...     batch = comm.recv(0)
>>> comm.broadcast(state if comm.rank == 0 else None, 0)  # doctest: +SKIP

Ranks are addressed by their rank in the communicator; collectives default to every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlinf_hpc.comm.dataplane import DataPlane
from rlinf_hpc.comm.directory import Directory
from rlinf_hpc.comm.mpi import world
from rlinf_hpc.comm.routing import GLOO, HOST
from rlinf_hpc.comm.sending import CommOptions

BACKENDS = ("auto", "mpi", "gloo", "nccl")


class StandaloneComm(DataPlane):
    """A `DataPlane` over one communicator whose collectives default to all of its ranks."""

    def broadcast(self, obj: Any, root: Any = 0, members: Any = None, timeout: float | None = None) -> Any:
        """``root``'s object on every rank (of ``members``, default all)."""
        return super().broadcast(obj, root, self._everyone(members), timeout)

    def gather(
        self, obj: Any, root: Any = 0, members: Any = None, timeout: float | None = None
    ) -> list[Any] | None:
        """Every rank's object on ``root`` in rank order; None elsewhere."""
        return super().gather(obj, root, self._everyone(members), timeout)

    def all_to_all(self, objs: list[Any], members: Any = None, timeout: float | None = None) -> list[Any]:
        """Rank i sends ``objs[j]`` to rank j; returns what every rank sent to this one."""
        return super().all_to_all(objs, self._everyone(members), timeout)

    def _everyone(self, members: Sequence[Any] | None) -> Any:
        return list(range(self.size)) if members is None else members


def init(backend: str = "auto", comm: Any = None, verify: bool = False) -> StandaloneComm:
    """The data plane for ``comm`` (default MPI COMM_WORLD), for a script started by mpiexec or
    srun — no coordinator, no config. Collective: every rank of ``comm`` calls it.

    ``backend`` picks where tensors land and how large CPU tensors travel: ``auto`` (tensors
    land on this rank's GPU when CUDA is there — GPU i for local rank i — else on the CPU;
    large GPU<->GPU leaves over NCCL), ``mpi`` (host memory over MPI only), ``gloo`` (large
    CPU leaves over torch.distributed gloo links), ``nccl`` (requires CUDA). ``verify`` turns
    on per-message checksums.
    """
    if backend not in BACKENDS:
        raise ValueError(f"init(backend={backend!r}): choose one of {', '.join(BACKENDS)}")
    device = "cpu"
    if backend in ("auto", "nccl"):
        device = _cuda_device()
        if backend == "nccl" and device == "cpu":
            raise ValueError("init(backend='nccl') needs CUDA, which this rank does not have; use 'auto'")
    options = CommOptions(cpu_link=GLOO if backend == "gloo" else HOST, verify=verify)
    communicator = comm if comm is not None else world()
    size = communicator.Get_size()
    devices = {rank: device for rank in range(size)} if device == "cpu" else {}
    plane = StandaloneComm(Directory(world_size=size, devices=devices), device, options, comm=communicator)
    if device != "cpu":  # every rank says where its tensors should land
        found = plane._comm.allgather(device)  # noqa: SLF001 - same package
        plane.set_directory(Directory(world_size=size, devices=dict(enumerate(found)), version=1))
    return plane


def _cuda_device() -> str:
    try:
        import torch
    except ImportError:
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    from rlinf_hpc.cluster import detect_environment

    local = detect_environment().local_rank or 0
    return f"cuda:{local % torch.cuda.device_count()}"
