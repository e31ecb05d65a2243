"""Data-parallel training of one model over its component group: torch DDP with AdamW (gloo on
CPU, NCCL on GPU), DeepSpeed ZeRO-1/2 with the same AdamW handed to it as a client optimizer
(no fused-Adam compile), or FSDP2 (``fully_shard``: parameters, gradients and AdamW state
sharded over the group, each transformer block its own unit). ZeRO-1/2 keep full parameters on
every rank, so the weight sync reads them as they are; FSDP2's are gathered a tensor at a time
(`rlinf_hpc.workers.weights.full_parameters`); ZeRO-3 is not offered."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from rlinf_hpc.engines.distributed import wrap_data_parallel


class Trainer:
    """``module`` for forward passes; `step` applies a loss; `new_optimizer` starts fresh."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: str,
        lr: float,
        backend: str = "ddp",
        zero_stage: int = 1,
        clip_norm: float | None = None,
        weight_decay: float = 0.01,
        eps: float = 1e-8,
    ) -> None:
        self.model = model
        self.device = device
        self.backend = backend
        self.clip_norm = clip_norm
        self.adam = {"weight_decay": weight_decay, "eps": eps}
        self.engine: Any = None
        if backend == "deepspeed":
            self._init_deepspeed(lr, zero_stage)
        elif backend == "fsdp2":
            shard_model(model, device)
            self.module = model
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, **self.adam)
        else:
            self.module = wrap_data_parallel(model, device)
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, **self.adam)

    def _init_deepspeed(self, lr: float, zero_stage: int) -> None:
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if self.device.startswith("cuda") else "cpu")
        # DeepSpeed reads its place from launcher variables; the process group exists already.
        os.environ["LOCAL_RANK"] = (
            str(torch.device(self.device).index or 0) if self.device.startswith("cuda") else "0"
        )
        import deepspeed

        dtype = next(self.model.parameters()).dtype
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": zero_stage},
            "gradient_clipping": self.clip_norm or 0.0,
            "bf16": {"enabled": dtype == torch.bfloat16},
            "fp16": {"enabled": dtype == torch.float16},
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        client = torch.optim.AdamW(self.model.parameters(), lr=lr, **self.adam)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=self.model, optimizer=client, config=config, dist_init_required=False
        )
        self.module = self.engine

    def close(self) -> None:
        """Drop the DDP wrapper (its reducer) or the DeepSpeed engine; call before the process
        group they hold is destroyed: a reducer outliving its group can abort the process at
        exit ("terminate called without an active exception", seen in CI). The model and the
        optimizer stay usable."""
        self.module = self.model
        self.engine = None
        gc.collect()

    def step(self, loss: torch.Tensor) -> float:
        """Backward, (clip,) optimizer step; returns the gradient norm before clipping."""
        with self.accumulate(first=True, last=True):
            self.backward(loss)
        return self.apply()

    @contextmanager
    def accumulate(self, first: bool, last: bool) -> Iterator[None]:
        """Around the forward and backward of one micro-batch of an optimizer step: ``first``
        clears the previous step's gradients; only the ``last`` one's backward all-reduces
        them over the data-parallel ranks (DDP's ``no_sync``, which must hold the forward
        too; DeepSpeed's accumulation boundary). Losses normalized by the whole step's counts
        then sum to the step's gradient; `apply` takes the step."""
        if self.engine is not None:
            self.engine.set_gradient_accumulation_boundary(last)
            yield
            if not last:
                self.engine.step()  # off the boundary: counts the micro-step, updates nothing
            return
        if first:
            self.optimizer.zero_grad(set_to_none=True)
        if self.backend == "fsdp2":  # reduce-scatter the gradients in the last backward only
            self.model.set_requires_gradient_sync(last)  # type: ignore[operator]
            yield
            return
        no_sync = getattr(self.module, "no_sync", None)
        if last or no_sync is None:
            yield
        else:
            with no_sync():
                yield

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate ``loss``'s gradients (inside `accumulate`)."""
        if self.engine is not None:
            self.engine.backward(loss)
        else:
            loss.backward()

    def apply(self) -> float:
        """(Clip,) optimizer step on the accumulated gradients; the gradient norm before
        clipping."""
        if self.engine is not None:
            self.engine.step()
            norm = self.engine.get_global_grad_norm()
            return float(norm) if norm is not None else float("nan")
        params = [p for p in self.model.parameters() if p.grad is not None]
        limit = self.clip_norm if self.clip_norm else float("inf")
        total = torch.nn.utils.clip_grad_norm_(params, limit)
        norm = (total.full_tensor() if hasattr(total, "full_tensor") else total).item()
        self.optimizer.step()
        return norm

    def new_optimizer(self, lr: float) -> None:
        """A fresh AdamW at ``lr`` (DDP). DeepSpeed keeps its optimizer (and Adam moments) and
        only takes the new learning rate: re-initializing an engine would stack ZeRO's hooks."""
        if self.engine is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            return
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, **self.adam)

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's state for a checkpoint. DDP: AdamW's (the same on every rank).
        DeepSpeed ZeRO-1/2: this rank's partition — the inner AdamW's state over the fp32
        master partition and that partition itself (ZeRO's own state_dict holds a loss-scaler
        object and fragment maps, which a checkpoint that never pickles cannot take)."""
        if self.engine is None:
            return self.optimizer.state_dict()
        zero = self.optimizer
        return {
            "base": zero.optimizer.state_dict(),
            "fp32_partitions": list(zero.single_partition_of_fp32_groups),
            "loss_scale": float(getattr(zero.loss_scaler, "cur_scale", 1.0)),
        }

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        if self.engine is None:
            self.optimizer.load_state_dict(state)
            return
        zero = self.optimizer
        zero.optimizer.load_state_dict(state["base"])
        with torch.no_grad():
            for partition, saved in zip(
                zero.single_partition_of_fp32_groups, state["fp32_partitions"], strict=True
            ):
                partition.copy_(saved)
        if hasattr(zero.loss_scaler, "cur_scale"):
            zero.loss_scaler.cur_scale = state["loss_scale"]

    def switch_state(self) -> Any:
        """What a full context switch moves: model and optimizer (DDP); the model only under
        DeepSpeed, whose ZeRO partitions stay where they are."""
        return self.model if self.engine is not None else (self.model, self.optimizer)


def shard_model(model: torch.nn.Module, device: str) -> None:
    """FSDP2 over the default process group (the component group's): each module of a class
    the model names unsplittable (Hugging Face's ``_no_split_modules``: its transformer blocks)
    is a unit, the rest (embeddings, final norm, a tied output layer) the root's."""
    from torch.distributed import get_world_size
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (get_world_size(),))
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
