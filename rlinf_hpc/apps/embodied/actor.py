"""The embodied app's PPO trainer: GAE over the trajectories its env ranks send, clipped
policy and value losses, data parallel over the actor ranks, weights pushed to the policy
ranks. (Configs written before it moved here name it ``embodied.workers:ActorWorker``, which
re-exports it.)"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np
import torch

from rlinf_hpc.algorithms import (
    RunningMeanStd,
    clipped_value_loss,
    gae_transitions,
    masked_whiten,
    ppo_policy_loss,
)
from rlinf_hpc.apps.embodied.model import build_model
from rlinf_hpc.apps.embodied.protocol import TRAJECTORY, WEIGHTS_TAG, rollout_tag
from rlinf_hpc.engines.distributed import (
    broadcast_parameters,
    init_group_process_group,
    release_process_group,
)
from rlinf_hpc.engines.training import Trainer
from rlinf_hpc.workers import Worker
from rlinf_hpc.workers.weights import send_weights


class ActorWorker(Worker):
    """PPO over the trajectories of its env ranks; data parallel over the actor ranks."""

    def setup(self, threads: int = 1) -> None:
        torch.set_num_threads(threads)
        self.config = self.job_config
        self.model = build_model(self.config)
        self.distributed = init_group_process_group(self.group, self.device)
        broadcast_parameters(self.model)
        self.trainer = self._trainer()
        self.version = 0  # updates applied
        #: The discounted returns' running deviation (``ppo.normalize_rewards``); the same on
        #: every actor rank (each update merges all ranks' batches).
        self.reward_rms = RunningMeanStd(1)

    def _trainer(self) -> Trainer:
        ppo = self.config.ppo
        return Trainer(
            self.model, self.device, ppo.lr, clip_norm=ppo.max_grad_norm, weight_decay=0.0, eps=1e-5
        )

    def on_regroup(self) -> None:
        """``auto`` gave the actor other ranks (it split the ranks policy and actor shared):
        data parallelism over the new group; weights, optimizer moments and the reward
        statistics stay (every actor rank holds the same)."""
        # a joining rank's setup broadcasts its fresh weights (it may be the group's first rank),
        # and so does DDP's construction: keep what this rank trained for `adopt_state`
        self._kept = copy.deepcopy(self.state_dict())
        optimizer = self.trainer.optimizer
        self._drop_process_group()
        self.distributed = init_group_process_group(self.group, self.device)
        broadcast_parameters(self.model)  # the collective a joining rank's setup calls
        self.trainer = self._trainer()
        self.trainer.optimizer = optimizer
        self.load_state_dict(self._kept)  # ranks that only stayed: as they were

    def adopt_state(self, source: int) -> None:
        """After ``auto`` moved the actor: every actor rank takes the state of world rank
        ``source`` (one that trained so far) — weights, optimizer moments, the reward statistics
        and the update count; a joining rank built them afresh in its ``setup``. Drops the copy
        `on_regroup` kept."""
        kept, self._kept = getattr(self, "_kept", None), None
        if kept is not None and kept["version"] != self.version:  # trained or loaded since
            kept = None
        if not self.distributed:
            if self.rank != source:
                raise RuntimeError(f"actor rank {self.rank} alone cannot adopt rank {source}'s state")
            return
        held = [(kept or self.state_dict()) if self.rank == source else None]
        torch.distributed.broadcast_object_list(held, src=self.group.world_ranks.index(source))
        self.load_state_dict(held[0])

    def _drop_process_group(self) -> None:
        """The trainer's DDP first, then the process group it holds (`Trainer.close`)."""
        if self.trainer is not None:
            self.trainer.close()
        self.trainer = None  # type: ignore[assignment]
        if self.distributed:
            release_process_group()
            self.distributed = False

    def teardown(self) -> None:
        if getattr(self, "distributed", False):
            self._drop_process_group()

    def push_weights(self, targets: list[int]) -> dict[str, float]:
        started = time.monotonic()
        nbytes = send_weights(self.comm, self.model, [(rank, WEIGHTS_TAG) for rank in targets])
        return {"seconds": time.monotonic() - started, "bytes": nbytes}

    def _receive(self, iteration: int) -> dict[str, torch.Tensor]:
        envs = self.comm.directory.groups["env"]
        mine = [rank for index, rank in enumerate(envs) if index % self.group_size == self.group_rank]
        parts = [self.comm.recv(rank, rollout_tag(iteration)) for rank in mine]
        self.behaviour = min(int(p["version"]) for p in parts)
        return {key: torch.as_tensor(np.concatenate([p[key] for p in parts], axis=1)) for key in TRAJECTORY}

    def train(self, iteration: int, lr: float) -> dict[str, Any]:
        """One PPO update on rollout ``iteration``."""
        ppo = self.config.ppo
        started = time.monotonic()
        data = self._receive(iteration)
        received = time.monotonic()
        cpu = time.process_time()
        staleness = self.version - self.behaviour
        if staleness > ppo.max_staleness:
            raise RuntimeError(
                f"rollout {iteration} was collected with weights {staleness} updates old "
                f"(ppo.max_staleness = {ppo.max_staleness})"
            )
        steps, n = data["rewards"].shape
        rewards = data["rewards"].float()
        if ppo.normalize_rewards:  # the statistics include this rollout, as the wrappers' do
            self.reward_rms.update(data["discounted"].flatten(), reduce=self.distributed)
            rewards = self.reward_rms.scale(rewards, ppo.reward_clip)
        with torch.no_grad():
            values = self.model.value(data["obs"].flatten(0, 1)).view(steps, n)
            next_values = self.model.value(data["next_obs"].flatten(0, 1)).view(steps, n)
        advantages, returns = gae_transitions(
            rewards, values, next_values, data["terminated"], data["truncated"], ppo.gamma, ppo.lam
        )
        flat = {
            "obs": data["obs"].flatten(0, 1),
            "actions": data["actions"].flatten(0, 1),
            "logp": data["logp"].flatten(0, 1).float(),
            "advantages": advantages.flatten(),
            "returns": returns.flatten(),
            "values": values.flatten(),
        }
        if staleness > 0 and ppo.decoupled_loss:  # the proximal policy: the weights this update starts from
            with torch.no_grad():
                flat["proximal"], _ = self.model.log_prob_entropy(flat["obs"], flat["actions"])
        for group in self.trainer.optimizer.param_groups:
            group["lr"] = lr
        total = steps * n
        size = max(1, total // ppo.minibatches)
        generator = torch.Generator().manual_seed(
            self.config.job.seed * 100_003 + iteration * 1_009 + self.group_rank
        )
        sums: dict[str, float] = {}
        updates = 0
        for _ in range(ppo.epochs):
            order = torch.randperm(total, generator=generator)
            for start in range(0, size * ppo.minibatches, size):
                rows = order[start : start + size]
                metrics = self._update({k: v[rows] for k, v in flat.items()})
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + value
                updates += 1
        if self.model.obs_rms is not None:  # after the update: it trained on the behaviour's figures
            self.model.obs_rms.update(data["obs"].flatten(0, 1), reduce=self.distributed)
        self.version += 1
        out = {key: value / updates for key, value in sums.items()}
        out |= {
            "staleness": staleness,
            "samples": total,
            "value_mean": float(values.mean()),
            "receive_s": received - started,
            "train_s": time.monotonic() - received,
            "train_cpu_s": time.process_time() - cpu,  # on a core (what a shared one slows)
            "version": self.version,
        }
        if ppo.normalize_rewards:  # what a reward is divided by (before the clip)
            out["reward_scale"] = float(self.reward_rms.std())
        return out

    def _update(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        ppo = self.config.ppo
        logp, entropy = self.model.log_prob_entropy(batch["obs"], batch["actions"])
        vpred = self.model.value(batch["obs"])
        mask = torch.ones(len(logp), 1)
        advantages = batch["advantages"].unsqueeze(-1)
        if ppo.normalize_advantages and len(logp) > 1:
            advantages = masked_whiten(advantages, mask)
        proximal = batch["proximal"].unsqueeze(-1) if "proximal" in batch else None
        pg_loss, pg = ppo_policy_loss(
            batch["logp"].unsqueeze(-1), logp.unsqueeze(-1), advantages, mask, ppo.clip_eps, ppo.clip_eps,
            proximal_log_prob=proximal, behaviour_weight_cap=ppo.behaviour_weight_cap,
        )  # fmt: skip
        v_loss, vf_clipfrac = clipped_value_loss(
            vpred.unsqueeze(-1),
            batch["returns"].unsqueeze(-1),
            batch["values"].unsqueeze(-1),
            mask,
            ppo.clip_value,
        )
        loss = pg_loss + ppo.vf_coef * v_loss - ppo.entropy_coef * entropy.mean()
        grad_norm = self.trainer.step(loss)
        return {
            "pg_loss": float(pg_loss.detach()),
            "vf_loss": float(v_loss.detach()),
            "entropy": float(entropy.mean().detach()),
            "approx_kl": float(pg.ppo_kl),
            "clipfrac": float(pg.pg_clipfrac),
            "vf_clipfrac": float(vf_clipfrac),
            "grad_norm": grad_norm,
        } | (
            {"behaviour_weight": float(pg.behaviour_weight), "behaviour_capped": float(pg.behaviour_capped)}
            if proximal is not None
            else {}
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.trainer.optimizer_state_dict(),
            "version": self.version,
            "reward_rms": self.reward_rms.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        if "reward_rms" in state:  # not in checkpoints written before reward normalization
            self.reward_rms.load_state_dict(state["reward_rms"])
        self.trainer.load_optimizer_state_dict(state["optimizer"])
        self.version = int(state["version"])
