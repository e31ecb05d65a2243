"""The PPO critic of the math job: values, GAE, and its own clipped value-loss updates.

A component of its own (placed like any other: own ranks, or sharing the actor's), between
inference and actor in the step's pipeline. ``values`` (a stage) scores every completion
token's state, computes GAE from the outcome reward (on the last token) and passes the raw
advantages and returns on; the actor whitens the advantages over the whole batch. ``update``
(the stage's finish) trains the critic on the step's samples — while the actor trains, when
they are on different ranks. The critic starts from the warm-started policy's weights (a
weight sync before RL) with a zero value head.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from rlinf_hpc.algorithms import clipped_value_loss, gae_advantage_return, outcome_token_rewards, pad_right
from rlinf_hpc.apps.math.policy import PolicyWorker
from rlinf_hpc.engines.distributed import (
    broadcast_parameters,
    init_group_process_group,
    release_process_group,
)
from rlinf_hpc.engines.training import Trainer
from rlinf_hpc.engines.value_model import ValueModel, sequence_values
from rlinf_hpc.workers.sharding import minibatch_share


class CriticWorker(PolicyWorker):
    def setup(self, threads: int = 1) -> None:
        super().setup(threads)
        grpo = self.config.grpo
        self.value_model = ValueModel(self.model).to(self.device)
        self.distributed = init_group_process_group(self.group, self.device)
        broadcast_parameters(self.value_model)
        self.trainer = Trainer(self.value_model, self.device, grpo.critic_lr, clip_norm=grpo.max_grad_norm)
        self._collected: list[dict[str, Any]] = []

    def switch_state(self) -> Any:
        return self.trainer.switch_state()

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.value_model.state_dict(), "optimizer": self.trainer.optimizer_state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value_model.load_state_dict(state["model"])
        self.trainer.load_optimizer_state_dict(state["optimizer"])

    def teardown(self) -> None:
        if self.distributed:
            release_process_group()

    def _tokens(self, items: list[dict[str, Any]]) -> tuple[list[list[int]], list[list[int]]]:
        prompts = [item["prompt_ids"] for item in items for _ in item["completions"]]
        return prompts, [ids for item in items for ids in item["completions"]]

    @torch.no_grad()
    def values(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The stage: per completion token values, GAE advantages and returns (not whitened)."""
        grpo = self.config.grpo
        prompts, completions = self._tokens(batch)
        bounds = [0]  # a forward per prompt's group (`grpo.batch_invariant`), else one for all
        for item in batch if grpo.batch_invariant else ():
            bounds.append(bounds[-1] + len(item["completions"]))
        bounds = bounds if len(bounds) > 1 else [0, len(prompts)]
        values = [
            value
            for a, b in zip(bounds, bounds[1:], strict=False)
            for value in sequence_values(
                self.value_model, prompts[a:b], completions[a:b], self.tokenizer.pad_id, self.device
            )
        ]
        value_mat, mask = pad_right([v.cpu() for v in values], grpo.max_response_length)
        scores = torch.tensor([r for item in batch for r in item["rewards"]], dtype=value_mat.dtype)
        rewards = outcome_token_rewards(scores, mask)
        advantages, returns = gae_advantage_return(
            rewards, value_mat, mask, grpo.gamma, grpo.lam, whiten=False
        )
        out, k = [], 0
        for item in batch:
            rows = range(k, k + len(item["completions"]))
            lengths = [len(ids) for ids in item["completions"]]
            extra = {
                "values": [value_mat[i, :n].tolist() for i, n in zip(rows, lengths, strict=True)],
                "returns": [returns[i, :n].tolist() for i, n in zip(rows, lengths, strict=True)],
                "advantages": [advantages[i, :n].tolist() for i, n in zip(rows, lengths, strict=True)],
            }
            out.append({**item, **extra})
            k += len(item["completions"])
        self._collected.extend(
            {k: item[k] for k in ("uid", "prompt_ids", "completions")}
            | {"values": e["values"], "returns": e["returns"]}
            for item, e in zip(batch, out, strict=True)
        )
        return out

    def update(self) -> dict[str, Any]:
        """Clipped value-loss steps on every sample of the step (gathered over the critic
        ranks, ordered by prompt, shared evenly), normalized over all critic ranks."""
        grpo = self.config.grpo
        started = time.monotonic()
        groups = [g for share in self.group.allgather(self._collected) for g in share]
        self._collected = []
        groups.sort(key=lambda g: g["uid"])
        prompts, completions = self._tokens(groups)
        old = [v for g in groups for v in g["values"]]
        targets = [r for g in groups for r in g["returns"]]
        lengths = [len(ids) for ids in completions]
        ranks = self.group_size if self.distributed else 1
        width = grpo.max_response_length
        sums, steps = np.zeros(3), 0
        for _ in range(grpo.update_epochs):
            for m in range(grpo.minibatches):
                part, dp = minibatch_share(
                    lengths, self.group_size, self.group_rank, grpo.minibatches, m, ranks
                )
                vpreds = sequence_values(
                    self.trainer.module, prompts[part], completions[part], self.tokenizer.pad_id, self.device
                )
                vpred_mat, mask = pad_right(vpreds, width)
                old_mat, _ = pad_right([torch.tensor(v) for v in old[part]], width)
                ret_mat, _ = pad_right([torch.tensor(r) for r in targets[part]], width)
                loss, clipfrac = clipped_value_loss(
                    vpred_mat, ret_mat, old_mat, mask, grpo.cliprange_value, grpo.loss_agg_mode, dp
                )
                grad_norm = self.trainer.step(loss)
                sums += (loss.item(), clipfrac.item(), grad_norm)
                steps += 1
        vf_loss, vf_clipfrac, grad_norm = self.group.allreduce(sums / steps) / self.group_size
        values = [x for v in old for x in v]
        return {
            "vf_loss": float(vf_loss),
            "vf_clipfrac": float(vf_clipfrac),
            "critic_grad_norm": float(grad_norm),
            "value_mean": sum(values) / max(len(values), 1),
            "critic_update_s": time.monotonic() - started,
        }
