"""A plain PyTorch script under ``mpiexec -n N`` that uses only ``rlinf_hpc.init()`` (no CLI,
no coordinator, no config): the README's adapter example, checked (tests/test_standalone_mpi.py)."""

import sys

import torch

import rlinf_hpc


def main() -> int:
    torch.set_num_threads(1)
    comm = rlinf_hpc.init(backend="auto")
    rank, size = comm.rank, comm.size

    # Point to point around a ring, structured objects with tensors.
    right, left = (rank + 1) % size, (rank - 1) % size
    handle = comm.irecv(left, tag="ring")
    comm.isend({"from": rank, "x": torch.full((1000,), float(rank))}, right, tag="ring")
    got = handle.wait(timeout=60)
    assert got["from"] == left and torch.equal(got["x"], torch.full((1000,), float(left))), got

    # Collectives over every rank by default.
    state = comm.broadcast({"w": torch.arange(1 << 20, dtype=torch.float32)} if rank == 0 else None, 0)
    assert torch.equal(state["w"], torch.arange(1 << 20, dtype=torch.float32))
    gathered = comm.gather({"rank": rank, "t": torch.tensor([rank])}, root=0)
    if rank == 0:
        assert [g["rank"] for g in gathered] == list(range(size)), gathered
    else:
        assert gathered is None
    exchanged = comm.all_to_all([(rank, j) for j in range(size)])
    assert exchanged == [(j, rank) for j in range(size)], exchanged
    if rank != 0:
        comm.send(f"done {rank}", 0, tag="done")
    else:
        assert [comm.recv(r, tag="done", timeout=60) for r in range(1, size)] == [
            f"done {r}" for r in range(1, size)
        ]
        print(f"STANDALONE OK on {size} ranks", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
