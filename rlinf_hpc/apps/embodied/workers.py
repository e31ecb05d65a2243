"""The embodied app's workers: simulators (`EnvWorker`), policy inference (`PolicyWorker`) and
PPO training (`ActorWorker`), each on ranks of its own or sharing them as [placement] says.

Per rollout, every env rank splits its simulators into ``env.pipeline_stages`` groups and asks
the policy for each group's actions through the ``observations`` channel (load-balanced over
the policy ranks); while the policy computes one group's actions, the env rank steps another.
A reply comes straight back from the policy rank that took the request (`Channel.put` returns
it). The env rank draws the sampling noise itself, so actions do not depend on which policy rank
served them. At the end the env rank sends its trajectory to an actor rank (env group rank
modulo actor ranks) and tells every policy rank it is done.
"""

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
from rlinf_hpc.apps.embodied.envs import GymBatch
from rlinf_hpc.apps.embodied.model import build_model
from rlinf_hpc.channel import EndOfStream
from rlinf_hpc.comm.waiting import Backoff
from rlinf_hpc.engines.distributed import (
    broadcast_parameters,
    init_group_process_group,
    release_process_group,
)
from rlinf_hpc.engines.training import Trainer
from rlinf_hpc.workers import Worker
from rlinf_hpc.workers.weights import receive_weights, send_weights

CHANNEL = "observations"
WEIGHTS_TAG = "embodied-weights"
DONE_TAG = "rollout-done"
#: The policy rank's wait for requests: yield the core this long after a request served, then
#: sleep at most this long between polls (the reply latency of a request that finds it asleep).
SERVE_SPIN_S = 1e-3
SERVE_MAX_SLEEP_S = 5e-4
#: What an env rank sends its actor rank per rollout: ``[steps, simulators, ...]`` arrays.
TRAJECTORY = ("obs", "next_obs", "actions", "logp", "rewards", "discounted", "terminated", "truncated")


def _actions_tag(slot: int) -> tuple[str, int]:
    return ("actions", slot)


def _rollout_tag(iteration: int) -> tuple[str, int]:
    return ("rollout", iteration)


class EnvWorker(Worker):
    """``env.envs_per_rank`` simulators in ``env.pipeline_stages`` groups."""

    replicated_state = False  # every rank steps simulators of its own

    def setup(self, threads: int = 1) -> None:
        torch.set_num_threads(threads)
        self.config = self.job_config
        env = self.config.env
        self.stages = env.pipeline_stages
        per_group = env.envs_per_rank // self.stages
        seed = self.config.job.seed
        self.groups = [
            GymBatch(
                env.id, per_group, seed, self.group_rank, env.max_episode_steps, env.options, k * per_group
            )
            for k in range(self.stages)
        ]
        self.spec = self.groups[0].spec
        self.obs = [g.reset() for g in self.groups]
        #: Each simulator's discounted return so far (``ppo.gamma``), sent with the rewards: the
        #: actor scales rewards by its running deviation (``ppo.normalize_rewards``).
        self.discounted = [np.zeros(len(o), dtype=np.float64) for o in self.obs]
        self.noise = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, self.group_rank, 1])))
        self.high = np.asarray(self.spec.high, dtype=np.float32) if not self.spec.discrete else None
        self.low = np.asarray(self.spec.low, dtype=np.float32) if not self.spec.discrete else None
        self._sent: Any = None
        self._last: tuple[int, dict[str, Any]] | None = None  # async: kept for a checkpoint

    def _draw(self, n: int) -> np.ndarray:
        if self.spec.discrete:
            return self.noise.random(n, dtype=np.float32)
        return self.noise.standard_normal((n, self.spec.action_dim), dtype=np.float32)

    def _ask(self, slot: int) -> int:
        request = {
            "obs": self.obs[slot],
            "noise": self._draw(len(self.obs[slot])),
            "slot": slot,
            "env": self.rank,
        }
        return self.channel(CHANNEL).put(request, weight=len(self.obs[slot]))

    def rollout(self, iteration: int, steps: int) -> dict[str, Any]:
        """``steps`` steps of every simulator; the trajectory goes to the actor."""
        started = time.monotonic()
        if self._sent is not None:
            self._sent.wait()  # the previous rollout reached its actor rank
            self._sent = None
        n = len(self.obs[0])
        record = {key: [[] for _ in range(self.stages)] for key in TRAJECTORY}
        gamma = self.config.ppo.gamma
        versions: set[int] = set()
        returns: list[float] = []
        lengths: list[int] = []
        wait_s = step_s = 0.0
        servers = {slot: self._ask(slot) for slot in range(self.stages)}
        for t in range(steps):
            for slot in range(self.stages):
                waited = time.monotonic()
                reply = self.comm.recv(servers[slot], tag=_actions_tag(slot))
                stepping = time.monotonic()
                wait_s += stepping - waited
                actions = reply["actions"]
                if not self.spec.discrete:
                    actions = np.clip(actions, self.low, self.high)
                result = self.groups[slot].step(actions)
                step_s += time.monotonic() - stepping
                discounted = self.discounted[slot] * gamma + result.reward
                for key, value in (
                    ("obs", self.obs[slot]), ("next_obs", result.final_obs), ("actions", reply["actions"]),
                    ("logp", reply["logp"]), ("rewards", result.reward), ("discounted", discounted),
                    ("terminated", result.terminated), ("truncated", result.truncated),
                ):  # fmt: skip
                    record[key][slot].append(value)
                self.discounted[slot] = np.where(result.terminated | result.truncated, 0.0, discounted)
                versions.add(int(reply["version"]))
                returns += result.episode_returns
                lengths += result.episode_lengths
                self.obs[slot] = result.obs
                if t + 1 < steps:
                    servers[slot] = self._ask(slot)
        policies = self.comm.directory.groups["policy"]
        handles = [self.comm.isend(iteration, rank, DONE_TAG) for rank in policies]
        # [T, n * stages, ...]: the groups side by side, each instance a column
        trajectory = {
            key: np.concatenate([np.stack(rows[slot]) for slot in range(self.stages)], axis=1)
            for key, rows in record.items()
        }
        trajectory["version"] = min(versions)
        if self.config.ppo.async_updates:  # a checkpoint may come before the actor trains on it
            self._last = (iteration, trajectory)
        self._send(iteration, trajectory)
        for handle in handles:
            handle.wait()
        return {
            "env_steps": steps * n * self.stages,
            "returns": returns,
            "lengths": lengths,
            "seconds": time.monotonic() - started,
            "wait_s": wait_s,
            "step_s": step_s,
            "versions": sorted(versions),
        }

    def _send(self, iteration: int, trajectory: dict[str, Any]) -> None:
        # not waited for here: the actor takes it when it trains (maybe while this rank
        # collects the next rollout); the next rollout makes sure it went
        actors = self.comm.directory.groups["actor"]
        self._sent = self.comm.isend(
            trajectory, actors[self.group_rank % len(actors)], _rollout_tag(iteration)
        )

    def resend(self, iteration: int) -> None:
        """After a resume: send the restored rollout ``iteration`` the actor has not trained on."""
        if self._last is None or self._last[0] != iteration:
            held = None if self._last is None else self._last[0]
            raise RuntimeError(f"the checkpoint holds rollout {held} of this rank, not {iteration}")
        self._send(*self._last)

    def state_dict(self) -> dict[str, Any]:
        return {
            "groups": [g.get_state() for g in self.groups],
            "obs": [o.copy() for o in self.obs],
            "discounted": [d.copy() for d in self.discounted],
            "noise": self.noise.bit_generator.state,
            "last": None if self._last is None else list(self._last),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for group, saved in zip(self.groups, state["groups"], strict=True):
            group.set_state(saved)
        self.obs = [np.asarray(o, dtype=np.float32) for o in state["obs"]]
        if "discounted" in state:  # not in checkpoints written before reward normalization
            self.discounted = [np.asarray(d, dtype=np.float64).copy() for d in state["discounted"]]
        self.noise.bit_generator.state = state["noise"]
        last = state.get("last")
        self._last = None if last is None else (int(last[0]), dict(last[1]))

    def teardown(self) -> None:
        for group in getattr(self, "groups", []):
            group.close()


class PolicyWorker(Worker):
    """Answers the env ranks' requests for actions with the weights it was last sent."""

    def setup(self, threads: int = 1) -> None:
        torch.set_num_threads(threads)
        self.config = self.job_config
        self.model = build_model(self.config).eval()
        self.version = 0

    def pull_weights(self, source: int, version: int) -> int:
        nbytes = receive_weights(self.comm, self.model, source, WEIGHTS_TAG)
        self.version = version
        return nbytes

    def serve(self) -> dict[str, Any]:
        """Take requests until every env rank said its rollout is done."""
        channel = self.channel(CHANNEL)
        envs = set(self.comm.directory.groups["env"])
        done: set[int] = set()
        requests = observations = batches = 0
        busy_s = 0.0
        limit = self.config.ppo.policy_batch
        merge = self.config.ppo.policy_batching == "merge"
        # One back-off for the whole loop: it spins (yields the core) for a moment after each
        # request served, when the next is likely near, then sleeps up to SERVE_MAX_SLEEP_S.
        # (A blocking get with a short timeout re-armed its spin on every call: an idle policy
        # rank spun ~45% of its time on the cores its env ranks step on.)
        backoff = Backoff(maximum=SERVE_MAX_SLEEP_S, spin=SERVE_SPIN_S)
        while done != envs:
            try:
                items = channel.get_batch(target_weight=limit, block=False)
            except EndOfStream:
                break
            if items:
                backoff.reset()
                started = time.monotonic()
                groups = [items] if merge else [[item] for item in items]
                for group in groups:  # one forward pass per group of requests
                    obs = torch.from_numpy(np.concatenate([i["obs"] for i in group]))
                    noise = torch.from_numpy(np.concatenate([i["noise"] for i in group]))
                    actions, logp = self.model.act(obs, noise)
                    actions, logp = actions.numpy(), logp.numpy()
                    first = 0
                    for item in group:
                        rows = slice(first, first + len(item["obs"]))
                        first = rows.stop
                        reply = {"actions": actions[rows], "logp": logp[rows], "version": self.version}
                        self.comm.isend(reply, item["env"], _actions_tag(item["slot"]))
                    observations += len(obs)
                    batches += 1
                self.comm.flush()
                requests += len(items)
                busy_s += time.monotonic() - started
            for rank in envs - done:
                found, _ = self.comm.try_recv(rank, DONE_TAG)
                if found:
                    done.add(rank)
            if not items and done != envs:
                backoff.sleep()
        return {"requests": requests, "observations": observations, "batches": batches, "busy_s": busy_s}


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
        parts = [self.comm.recv(rank, _rollout_tag(iteration)) for rank in mine]
        self.behaviour = min(int(p["version"]) for p in parts)
        return {key: torch.as_tensor(np.concatenate([p[key] for p in parts], axis=1)) for key in TRAJECTORY}

    def train(self, iteration: int, lr: float) -> dict[str, Any]:
        """One PPO update on rollout ``iteration``."""
        ppo = self.config.ppo
        started = time.monotonic()
        data = self._receive(iteration)
        received = time.monotonic()
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
        pg_loss, pg = ppo_policy_loss(
            batch["logp"].unsqueeze(-1), logp.unsqueeze(-1), advantages, mask, ppo.clip_eps, ppo.clip_eps,
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
        }

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
