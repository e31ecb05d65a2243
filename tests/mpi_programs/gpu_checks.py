"""GPU data-plane checks under ``mpiexec -n 2`` on a machine with CUDA (tests/test_comm_gpu.py).

With one GPU both ranks use it and GPU tensors take the host path (chunked device->host
staging); with two or more GPUs, GPU<->GPU leaves take a lazily created NCCL link.
"""

from __future__ import annotations

import sys

import torch
from harness import run_checks

from rlinf_hpc.comm import CommOptions, DataPlane, Directory
from rlinf_hpc.comm.mpi import world


def main() -> int:
    comm = world()
    rank = comm.Get_rank()
    num_gpus = torch.cuda.device_count()
    device = f"cuda:{rank % num_gpus}"
    torch.cuda.set_device(rank % num_gpus)
    devices = {0: "cuda:0", 1: f"cuda:{1 % num_gpus}"}
    directory = Directory(groups={"gpu": [0, 1]}, devices=devices, nodes={0: 0, 1: 0}, world_size=2)
    checks = []

    def staged() -> None:
        # host path forced: chunked device->host staging, receiver moves onto its own GPU
        plane = DataPlane(
            directory, device=device, options=CommOptions(link_min_bytes=1 << 62, chunk_bytes=4 << 20)
        )
        big = torch.arange(5_000_000, dtype=torch.float32, device=device)
        if rank == 0:
            plane.send({"big": big, "cpu": torch.ones(3)}, 1)
            back = plane.recv(1, device="cpu")
            assert back.device.type == "cpu" and torch.equal(back, big.cpu())
        else:
            got = plane.recv(0)
            assert got["big"].device == torch.device(device) and torch.equal(got["big"], big)
            assert got["cpu"].device == torch.device(device)  # lands on the receiver's device
            plane.send(got["big"], 0)
        assert plane.pending()["links_created"] == 0

    checks.append(("staged_host_path", staged))

    if num_gpus >= 2:

        def nccl() -> None:
            plane = DataPlane(directory, device=device)
            tensor = torch.full((16 * 2**20,), 2.0, device=device)
            for _ in range(2):
                if rank == 0:
                    plane.send(tensor, 1)
                else:
                    got = plane.recv(0)
                    assert got.device == torch.device(device) and float(got.sum()) == 2.0 * tensor.numel()
            assert plane.pending()["links_created"] == (1 if rank == 0 else 0)
            assert plane.pending()["links_live"] == 1

        def nccl_fallback() -> None:
            plane = DataPlane(directory, device=device, options=CommOptions(link_timeout_s=5))
            plane.links.fault_bad_address = rank == 0
            tensor = torch.full((4 * 2**20,), 3.0, device=device)
            if rank == 0:
                plane.send(tensor, 1)
            else:
                got = plane.recv(0)
                assert torch.equal(got, tensor.to(device))
            assert plane.pending()["links_live"] == 0

        def nccl_fails_during_transfer() -> None:
            plane = DataPlane(directory, device=device, options=CommOptions(link_timeout_s=5))
            tensors = [torch.full((4 * 2**20,), float(k), device=device) for k in range(3)]
            if rank == 0:
                plane.send(tensors[0], 1)  # the link is up
                plane.links.fault_fail_sends = 1
                plane.send(tensors[1], 1)  # fails on the link: resent over MPI
                plane.send(tensors[2], 1)  # the pair's host path
                assert plane.pending()["link_resends"] == 1, plane.pending()
            else:
                for tensor in tensors:
                    got = plane.recv(0)
                    assert got.device == torch.device(device) and torch.equal(got, tensor.to(device))
            assert plane.pending()["links_live"] == 0, plane.pending()

        checks += [
            ("nccl_link", nccl),
            ("nccl_setup_failure_falls_back", nccl_fallback),
            ("nccl_link_fails_during_transfer", nccl_fails_during_transfer),
        ]

    return run_checks(checks, f"ALL GPU CHECKS OK ({num_gpus} GPU(s))", "GPU_CHECKS")


if __name__ == "__main__":
    sys.exit(main())
