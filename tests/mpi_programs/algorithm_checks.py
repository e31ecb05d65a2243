"""Data-parallel loss normalization under real DDP (gloo): two ranks holding unequal shares of
a batch get, after DDP's gradient average, the gradient of the whole batch on one rank — for
every loss_agg_mode — while a plain per-rank mean does not; and running observation
statistics merged over the two ranks equal those of the whole batch on one (tests/test_algorithms.py
runs this under mpiexec -n 2)."""

from __future__ import annotations

import copy
import gc
import sys

import torch

from rlinf_hpc.algorithms import LOSS_AGG_MODES, DataParallelScale, RunningMeanStd, agg_loss, pad_right
from rlinf_hpc.comm import create_group_comm
from rlinf_hpc.comm.mpi import world
from rlinf_hpc.engines.distributed import init_group_process_group, release_process_group, wrap_data_parallel


def token_losses(model: torch.nn.Module, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (model(x) ** 2).sum(-1) * weights  # [sequences, T]


def gradient(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def main() -> int:
    torch.set_num_threads(1)
    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    assert size == 2, "run with mpiexec -n 2"
    group = create_group_comm("dp-check", list(range(size)), tag=7)
    assert init_group_process_group(group, "cpu", timeout_s=60)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 4, generator=generator, dtype=torch.float64)
    weights = torch.randn(6, 5, generator=generator, dtype=torch.float64)
    lengths = [5, 1, 3, 2, 4, 1]
    mask = pad_right([torch.ones(n, dtype=torch.float64) for n in lengths], 5)[1]
    share = [slice(0, 2), slice(2, 6)][rank]  # 6 tokens on rank 0, 10 on rank 1
    dp = DataParallelScale(tokens=float(sum(lengths)), sequences=6.0, ranks=size)
    torch.manual_seed(1)
    base = torch.nn.Linear(4, 3).double()
    for mode in LOSS_AGG_MODES:
        single = copy.deepcopy(base)
        agg_loss(token_losses(single, x, weights), mask, mode).backward()
        for scale in (dp, None):
            replica = copy.deepcopy(base)
            ddp = wrap_data_parallel(replica, "cpu")
            agg_loss(token_losses(ddp, x[share], weights[share]), mask[share], mode, scale).backward()
            close = torch.allclose(gradient(replica), gradient(single), rtol=1e-10, atol=1e-12)
            if scale is not None:
                assert close, f"{mode}: DDP gradient with the global normalization differs from one rank's"
            else:
                assert not close, f"{mode}: a per-rank mean matched the global one (the check is blind)"
    check_running_statistics(rank)
    del ddp, replica  # DDP before its process group: a reducer outliving its group can abort
    gc.collect()  # the process at exit ("terminate called without an active exception", CI)
    release_process_group()
    comm.Barrier()
    if rank == 0:
        print(f"DP NORMALIZATION OK for {', '.join(LOSS_AGG_MODES)} on {size} ranks", flush=True)
        print("RUNNING STATISTICS OK", flush=True)


def check_running_statistics(rank: int) -> None:
    """Two updates of unequal shares on each rank: every rank ends with the statistics of all
    rows; without the reduction a rank has only its own."""
    generator = torch.Generator().manual_seed(2)
    batches = [torch.randn(n, 3, generator=generator) * 4 + 1 for n in (5, 11, 8, 2)]
    shares = [batches[0], batches[2]] if rank == 0 else [batches[1], batches[3]]
    merged, alone, whole = RunningMeanStd(3), RunningMeanStd(3), RunningMeanStd(3)
    for rows in shares:
        merged.update(rows)
        alone.update(rows, reduce=False)
    whole.update(torch.cat(batches[:2]), reduce=False)
    whole.update(torch.cat(batches[2:]), reduce=False)
    assert torch.allclose(merged.mean, whole.mean) and torch.allclose(merged.var, whole.var), "not merged"
    assert int(merged.count) == 26 and int(alone.count) == 13
    assert not torch.allclose(alone.mean, whole.mean), "one rank's rows matched all (the check is blind)"
    return 0


if __name__ == "__main__":
    sys.exit(main())
