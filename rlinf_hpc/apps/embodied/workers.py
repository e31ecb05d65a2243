"""The embodied app's rollout workers: simulators (`EnvWorker`) and policy inference
(`PolicyWorker`); PPO training (`ActorWorker`) is in `actor`. Each on ranks of its own or
sharing them as [placement] says.

Per rollout, every env rank splits its simulators into ``env.pipeline_stages`` groups and asks
the policy for each group's actions through the ``observations`` channel (load-balanced over
the policy ranks); while the policy computes one group's actions, the env rank steps another.
A reply comes straight back from the policy rank that took the request (`Channel.put` returns
it). The env rank draws the sampling noise itself, so actions do not depend on which policy rank
served them. At the end the env rank sends its trajectory to an actor rank (env group rank
modulo actor ranks) and tells every policy rank it is done.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from rlinf_hpc.apps.embodied.actor import ActorWorker
from rlinf_hpc.apps.embodied.envs import GymBatch
from rlinf_hpc.apps.embodied.model import build_model
from rlinf_hpc.apps.embodied.protocol import (
    CHANNEL,
    DONE_TAG,
    TRAJECTORY,
    WEIGHTS_TAG,
    actions_tag,
    rollout_tag,
)
from rlinf_hpc.channel import EndOfStream
from rlinf_hpc.comm.waiting import Backoff
from rlinf_hpc.workers import Worker
from rlinf_hpc.workers.weights import receive_weights

__all__ = ["ActorWorker", "EnvWorker", "PolicyWorker"]  # ActorWorker: configs written before it moved

#: The policy rank's wait for requests: yield the core this long after a request served, then
#: sleep at most this long between polls (the reply latency of a request that finds it asleep).
SERVE_SPIN_S = 1e-3
SERVE_MAX_SLEEP_S = 5e-4


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
        started, cpu = time.monotonic(), time.process_time()
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
                reply = self.comm.recv(servers[slot], tag=actions_tag(slot))
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
            "cpu_s": time.process_time() - cpu,
            "versions": sorted(versions),
        }

    def _send(self, iteration: int, trajectory: dict[str, Any]) -> None:
        # not waited for here: the actor takes it when it trains (maybe while this rank
        # collects the next rollout); the next rollout makes sure it went
        actors = self.comm.directory.groups["actor"]
        self._sent = self.comm.isend(
            trajectory, actors[self.group_rank % len(actors)], rollout_tag(iteration)
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
        cpu = time.process_time()
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
                        self.comm.isend(reply, item["env"], actions_tag(item["slot"]))
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
        return {
            "requests": requests,
            "observations": observations,
            "batches": batches,
            "busy_s": busy_s,
            "cpu_s": time.process_time() - cpu,
        }
