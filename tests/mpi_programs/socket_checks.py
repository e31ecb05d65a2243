"""No open rendezvous server: after a gloo link and a DDP process group are set up, this job's
ranks listen on no TCP port bound to a wildcard address that they did not have before (the
launcher's own sockets, inherited, are the baseline). Run by tests/test_security_mpi.py."""

from __future__ import annotations

import sys

import psutil
import torch

from rlinf_hpc.comm import CommOptions, DataPlane, Directory, create_group_comm
from rlinf_hpc.comm.mpi import world
from rlinf_hpc.engines.distributed import init_group_process_group, release_process_group, wrap_data_parallel

WILDCARDS = {"0.0.0.0", "::", ""}
torch.set_num_threads(1)


def listening() -> set[tuple[str, int]]:
    connections = psutil.Process().net_connections("tcp")
    return {(c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN}


def main() -> int:
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    before = listening()
    plane = DataPlane(Directory(world_size=size), options=CommOptions(cpu_link="gloo", link_timeout_s=30))
    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MB: above the link threshold
    if rank == 0:
        plane.send(big, 1, timeout=60)
    elif rank == 1:
        assert torch.equal(plane.recv(0, timeout=60), big)
        assert plane.pending()["links_live"] == 1, plane.pending()
    group = create_group_comm("actor", list(range(size)), tag=7)
    assert init_group_process_group(group, "cpu", timeout_s=60)
    model = wrap_data_parallel(torch.nn.Linear(8, 2), "cpu")
    model(torch.randn(4, 8)).sum().backward()
    opened = listening() - before
    wild = sorted(address for address in opened if address[0] in WILDCARDS)
    assert not wild, f"rank {rank} listens on wildcard addresses {wild} after setup (new: {sorted(opened)})"
    release_process_group()
    comm.Barrier()
    if rank == 0:
        print(f"NO WILDCARD LISTENERS on {size} ranks (new sockets on rank 0: {sorted(opened)})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
