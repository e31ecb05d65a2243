"""The actor of the math GRPO job: supervised warm start (cached), then GRPO updates.

Its ranks train data-parallel (torch DDP over the group's own process group: gloo on CPU, NCCL
on GPU). During a step the actor stage only collects prompt groups; ``update`` then gathers them
over the actor ranks, orders them by prompt (so the result does not depend on which rank
received what), gives each rank an equal contiguous share and takes ``update_epochs x
minibatches`` optimizer steps. ``push_weights`` sends the new policy to rollout and inference.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlinf_hpc.algorithms import (
    agg_loss,
    grpo_outcome_advantage,
    kl_penalty,
    masked_mean,
    masked_whiten,
    outcome_token_rewards,
    pad_right,
    ppo_policy_loss,
)
from rlinf_hpc.apps.math.policy import WEIGHTS_TAG, PolicyWorker
from rlinf_hpc.apps.math.tasks.teacher import make_teacher
from rlinf_hpc.engines.distributed import (
    broadcast_parameters,
    init_group_process_group,
    release_process_group,
)
from rlinf_hpc.engines.generation import sequence_logprobs, shared_prefix_logprobs
from rlinf_hpc.engines.training import Trainer
from rlinf_hpc.runtime.progress import Progress
from rlinf_hpc.workers.sharding import even_share, minibatch_share, split_to_count, token_micro_batches
from rlinf_hpc.workers.weights import full_parameters, send_tensors, send_weights


class ActorWorker(PolicyWorker):
    def setup(self, threads: int = 1) -> None:
        super().setup(threads)
        self._collected: list[dict[str, Any]] = []
        self.teacher = make_teacher(self.config.sft, self.config.task, self.config.job.seed)
        self._start_training()

    def _start_training(self) -> None:
        grpo = self.config.grpo
        if self.config.model.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        deepspeed = grpo.train_backend == "deepspeed"
        always = grpo.train_backend != "ddp"  # DeepSpeed and FSDP2's mesh want a group even of one
        self.distributed = init_group_process_group(self.group, self.device, always=always)
        broadcast_parameters(self.model)
        clip = grpo.max_grad_norm if deepspeed else self.config.sft.max_grad_norm  # DeepSpeed: fixed
        self.trainer = Trainer(
            self.model, self.device, self.config.sft.lr, grpo.train_backend, grpo.zero_stage, clip
        )

    def switch_state(self) -> Any:
        return self.trainer.switch_state()

    @property  # type: ignore[override]
    def replicated_state(self) -> bool:
        """DDP ranks hold the same model and optimizer; ZeRO and FSDP2 ranks their own part."""
        return self.config.grpo.train_backend == "ddp"

    @property  # type: ignore[override]
    def reshardable_state(self) -> bool:
        """FSDP2's state goes through torch.distributed.checkpoint: any width can load it."""
        return self.config.grpo.train_backend == "fsdp2"

    def state_dict(self) -> dict[str, Any] | None:
        """The policy and the RL optimizer (Adam moments, step, learning rate); FSDP2's are
        `sharded_state`."""
        if self.config.grpo.train_backend == "fsdp2":
            return None
        return {"model": self.model.state_dict(), "optimizer": self.trainer.optimizer_state_dict()}

    def state_nbytes(self) -> int:
        """This rank's parameters (its shards under FSDP2) and AdamW's two moments per trained
        one, which its first step creates: the checkpoint's size, estimated at the start
        without building the state (torch's ``get_state_dict`` would step the optimizer to
        create its moments, weight decay moving the weights)."""
        if self.replicated_state and self.group_rank != 0:
            return 0  # DDP: rank 0 writes it (ZeRO's ranks are counted whole: an upper bound)
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]
        nbytes = sum(p.numel() * p.element_size() for p in local)
        return nbytes + 2 * sum(p.numel() * p.element_size() for p in local if p.requires_grad)

    def sharded_state(self) -> dict[str, Any] | None:
        """FSDP2: the policy and the RL optimizer as this rank's shards (DTensors), for
        torch.distributed.checkpoint."""
        if self.config.grpo.train_backend != "fsdp2":
            return None
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.model, self.trainer.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_sharded_state(self, read: Any) -> None:
        """Resume FSDP2: the RL optimizer as the warm start leaves it, ``read`` fills this
        rank's shards of it and of the policy in place (re-sharded to this group's width)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        self._start_rl()
        state = self.sharded_state()
        assert state is not None, "load_sharded_state on an actor that is not FSDP2"
        read(state)
        set_state_dict(
            self.model,
            self.trainer.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the RL optimizer as the warm start leaves it, then the saved state."""
        self._start_rl()
        self.model.load_state_dict(state["model"])
        self.trainer.load_optimizer_state_dict(state["optimizer"])

    def on_regroup(self) -> None:
        """The actor group changed (re-partition): rebuild data parallelism over the new group;
        weights and optimizer state stay."""
        if self.config.grpo.train_backend != "ddp":
            raise RuntimeError(
                f"the {self.config.grpo.train_backend} actor cannot change its ranks while the job "
                "runs (its shards are fixed until a checkpoint re-shards them); keep the actor's "
                'ranks, or use train_backend = "ddp"'
            )
        optimizer = self.trainer.optimizer
        self._drop_process_group()
        self.distributed = init_group_process_group(self.group, self.device)
        broadcast_parameters(self.model)
        self.trainer = Trainer(
            self.model, self.device, self.config.grpo.lr, clip_norm=self.config.grpo.max_grad_norm
        )
        self.trainer.optimizer = optimizer  # Adam moments survive the move

    def _drop_process_group(self) -> None:
        """DDP first, then the process group it holds (`Trainer.close`)."""
        self.trainer.close()
        if self.distributed:
            release_process_group()
            self.distributed = False

    def teardown(self) -> None:
        if getattr(self, "trainer", None) is not None:
            self._drop_process_group()

    # -- warm start ------------------------------------------------------------------------------
    def _cache_file(self) -> Path | None:
        sft = self.config.sft
        if not sft.cache_dir or self.config.grpo.train_backend == "fsdp2":  # no whole state_dict
            return None
        key = json.dumps(
            {
                "task": self.config.task.model_dump(mode="json"),
                "model": self.config.model.model_dump(mode="json"),
                "sft": sft.model_dump(mode="json", exclude={"cache_dir"}),
                "seed": self.config.job.seed,
                "ranks": self.group_size,
                "backend": self.config.grpo.train_backend,
                "vocab": getattr(self.tokenizer, "chars", self.tokenizer.vocab_size),
                "format": 3,
            },
            sort_keys=True,
        )
        return Path(sft.cache_dir).expanduser() / f"sft-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"

    def warm_start(self) -> dict[str, Any]:
        """Supervised steps on the task's answers (or load them from the cache)."""
        sft = self.config.sft
        started = time.monotonic()
        if sft.steps == 0:  # RL starts from the model as loaded: nothing to train or cache
            self._start_rl()
            return {"cached": False, "seconds": 0.0, "loss": None, "steps": 0, "path": None}
        cache = self._cache_file()
        loaded = False
        if self.group_rank == 0 and cache is not None and cache.is_file():
            try:
                self.model.load_state_dict(torch.load(cache, map_location=self.device, weights_only=True))
                loaded = True
            except Exception as exc:  # noqa: BLE001 - a damaged or foreign file: train instead
                self.log.warning("warm-start cache %s is unusable (%s): training again", cache, exc)
        if self.group.bcast(loaded):
            broadcast_parameters(self.model)
            self._start_rl()
            self.log.info("warm start loaded from %s", cache)
            return {"cached": True, "seconds": time.monotonic() - started, "loss": None, "path": str(cache)}
        lo, hi = even_share(sft.batch_size, self.group_size, self.group_rank)
        loss_value = float("nan")
        checks = self.task.train_batch(0, sft.check_size, stream="sft-check")
        accuracy = None
        steps_run = 0
        progress = Progress("warm start", sft.steps, "steps")
        for step in range(sft.steps):
            if sft.stop_at_accuracy and step % sft.check_every == 0 and step:
                accuracy = self._greedy_accuracy(checks)
                if accuracy >= sft.stop_at_accuracy:
                    break
            steps_run = step + 1
            problems = self.task.train_batch(step, sft.batch_size, stream="sft")
            mine = problems[lo:hi]
            loss = self._sft_loss(mine)
            self.trainer.step(loss)
            loss_value = loss.item()
            progress.advance(1)
            if (step + 1) % max(1, sft.check_every) == 0 and self.group_rank == 0:
                self.log.info("warm start step %d/%d: loss %.3f", step + 1, sft.steps, loss_value)
        progress.close()
        self._start_rl()
        if cache is not None and self.group_rank == 0:
            try:
                cache.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache.with_suffix(".tmp")
                torch.save(self.model.state_dict(), tmp)
                tmp.replace(cache)
            except OSError as exc:  # a cache is a convenience: the trained weights are in hand
                self.log.warning(
                    "could not write the warm-start cache %s (%s): continuing without it", cache, exc
                )
        return {
            "cached": False,
            "seconds": time.monotonic() - started,
            "loss": loss_value,
            "steps": steps_run,
            "train_accuracy": accuracy,
            "path": str(cache),
        }

    def _greedy_accuracy(self, problems: list[Any]) -> float:
        """Greedy accuracy on training problems (the warm start's stopping check); every actor
        rank checks a share and the counts are summed, so all ranks stop together."""
        from rlinf_hpc.apps.math.tasks import score_completion
        from rlinf_hpc.engines.generation import generate

        mine = problems[self.group_rank :: self.group_size]
        completions = generate(
            self.model,
            self.tokenizer,
            self.prompts.encode([p.prompt for p in mine], self.tokenizer),
            self.config.grpo.max_response_length,
            device=self.device,
        )
        right = sum(
            score_completion(self.tokenizer.decode(c.ids), p.answer, c.ended, 0.0).correct
            for p, c in zip(mine, completions, strict=True)
        )
        return self.group.allreduce(right) / len(problems)

    def _start_rl(self) -> None:
        """RL starts with fresh Adam moments (DDP), its own learning rate and clipping."""
        self.trainer.new_optimizer(self.config.grpo.lr)
        self.trainer.clip_norm = self.config.grpo.max_grad_norm

    def _sft_loss(self, problems: list[Any]) -> torch.Tensor:
        eos = self.tokenizer.eos_id
        prompts = self.prompts.encode([p.prompt for p in problems], self.tokenizer)
        targets = [self.tokenizer.encode(self.teacher.answer(p)) + [eos] for p in problems]
        logprobs = sequence_logprobs(
            self.trainer.module, prompts, targets, self.tokenizer.pad_id, self.device
        )
        return -torch.cat(logprobs).mean()

    # -- GRPO ----------------------------------------------------------------------------------
    def collect(self, batch: list[dict[str, Any]]) -> None:
        """The actor stage: keep this micro-batch's groups for the update."""
        self._collected.extend(batch)

    def update(self) -> dict[str, Any]:
        """One RL update on every group collected by any actor rank this step: every rank
        gathers the whole batch, computes the advantages of all of it (GRPO's groups, or the
        critic's GAE whitened over the batch), and trains on an equal contiguous share;
        ``update_epochs x minibatches`` optimizer steps whose losses are normalized over all
        actor ranks (the global token or sequence count), so N ranks optimize what one would."""
        grpo = self.config.grpo
        started = time.monotonic()
        groups = [g for share in self.group.allgather(self._collected) for g in share]
        self._collected = []
        groups.sort(key=lambda g: g["uid"])
        samples = [
            {
                "prompt": g["prompt_ids"],
                "ids": ids,
                "old": g["old_logprobs"][j],
                "ref": g["ref_logprobs"][j] if "ref_logprobs" in g else None,
                "uid": g["uid"],
                "score": g["rewards"][j],
                "gae": g["advantages"][j] if "advantages" in g else None,
            }
            for g in groups
            for j, ids in enumerate(g["completions"])
        ]
        advantages = self._advantages(samples)
        step = groups[0]["step"] if groups else 0
        if grpo.control == "frozen" or (grpo.algorithm == "ppo" and step < grpo.critic_warmup_steps):
            totals: dict[str, float] = {}
        elif grpo.control == "supervised":
            totals = self._supervised_steps(step)
        else:
            totals = self._policy_steps(samples, advantages)
        correct = [c for g in groups for c in g["correct"]]
        formed = [w for g in groups for w in g["well_formed"]]
        rewards = [r for g in groups for r in g["rewards"]]
        return {
            "reward": sum(rewards) / len(rewards),
            "sample_accuracy": sum(correct) / len(correct),
            "well_formed": sum(formed) / len(formed),
            **totals,
            "tokens": sum(g["tokens"] for g in groups),
            "groups": len(groups),
            "update_s": time.monotonic() - started,
        }

    def _advantages(self, samples: list[dict[str, Any]]) -> torch.Tensor:
        """``[samples, max_response_length]`` advantages of the whole batch."""
        grpo = self.config.grpo
        width = grpo.max_response_length
        _, mask = pad_right([torch.zeros(len(s["ids"])) for s in samples], width)
        if grpo.algorithm == "ppo":
            gae, _ = pad_right([torch.as_tensor(s["gae"], dtype=torch.float32) for s in samples], width)
            return masked_whiten(gae, mask)
        scores = torch.tensor([s["score"] for s in samples], dtype=torch.float32)
        advantages, _ = grpo_outcome_advantage(
            outcome_token_rewards(scores, mask), mask, [s["uid"] for s in samples],
            norm_adv_by_std=grpo.norm_adv_by_std,
        )  # fmt: skip
        return advantages

    def _policy_steps(self, samples: list[dict[str, Any]], advantages: torch.Tensor) -> dict[str, float]:
        """The clipped-objective optimizer steps on this rank's share; metrics averaged over
        the steps and the actor ranks. Off-policy (``grpo.decoupled_loss``) each minibatch's
        clip is taken around its own log-probs at its first forward in this update (its
        proximal policy; no extra forward), weighted by their ratio to the behaviour's."""
        grpo = self.config.grpo
        decoupled = grpo.decoupled_loss and grpo.off_policy_steps > 0
        keys = ("loss", "pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy", "kl", "grad_norm")
        keys += ("behaviour_weight", "behaviour_capped") if decoupled else ()
        ranks = self.group_size if self.distributed else 1
        lengths = [len(x["ids"]) for x in samples]
        parts = [
            minibatch_share(lengths, self.group_size, self.group_rank, grpo.minibatches, m, ranks)
            for m in range(grpo.minibatches)
        ]
        proximal: dict[tuple[int, int], torch.Tensor] | None = {} if decoupled else None
        sums = np.zeros(len(keys))
        for _ in range(grpo.update_epochs):
            for m, (part, dp) in enumerate(parts):
                sums += self._minibatch_step(samples[part], advantages[part], dp, proximal, m)
        means = self.group.allreduce(sums / (grpo.update_epochs * len(parts))) / self.group_size
        return dict(zip(keys, (float(v) for v in means), strict=True))

    def _minibatch_step(
        self,
        chunk: list[dict[str, Any]],
        advantages: torch.Tensor,
        dp: Any,
        proximal: dict[tuple[int, int], torch.Tensor] | None,
        m: int,
    ) -> np.ndarray:
        """One optimizer step on minibatch ``m``'s part of this rank's share, accumulated over
        micro-batches of at most ``grpo.micro_batch_tokens`` padded tokens; its metrics (in
        `_policy_steps`' order, token-weighted over the micro-batches). Every micro-batch's
        loss is normalized by the whole minibatch's global counts (``dp``), so their gradients
        sum to the minibatch's at any budget. ``proximal``: the decoupled loss's log-probs per
        (minibatch, micro-batch), filled in at their first forward."""
        lengths = [len(s["prompt"]) + len(s["ids"]) for s in chunk]
        micro = token_micro_batches(lengths, self.config.grpo.micro_batch_tokens)
        if self.config.grpo.train_backend == "fsdp2" and self.group_size > 1:
            # every forward all-gathers the shards: each rank must run as many micro-batches
            micro = split_to_count(micro, lengths, max(self.group.allgather(len(micro))))
        parts = []
        for j, index in enumerate(micro):
            with self.trainer.accumulate(first=j == 0, last=j == len(micro) - 1):
                if not index:  # a forward the other ranks run too; it contributes nothing
                    self._micro_batch_loss([chunk[0]], advantages[[0]], dp, None, (m, j), weight=0.0)
                    continue
                parts.append(
                    self._micro_batch_loss([chunk[i] for i in index], advantages[index], dp, proximal, (m, j))
                )
        values = parts[0][0] if len(parts) == 1 else _combine_micro_metrics(parts)
        grad_norm = self.trainer.apply()
        return np.concatenate([values[:7], [grad_norm], values[7:]])

    def _micro_batch_loss(
        self,
        part: list[dict[str, Any]],
        advantages: torch.Tensor,
        dp: Any,
        proximal: dict[tuple[int, int], torch.Tensor] | None,
        key: tuple[int, int],
        weight: float = 1.0,
    ) -> tuple[np.ndarray, int]:
        """Forward and backward of one micro-batch: its metrics (losses as its share of the
        minibatch's, the rest as its own token means) and its response tokens."""
        grpo = self.config.grpo
        width = grpo.max_response_length
        # FSDP2 all-gathers in every forward: one forward per micro-batch on every rank, not
        # the shared-prefix pair that only micro-batches with a repeated prompt take
        forward = sequence_logprobs if grpo.train_backend == "fsdp2" else shared_prefix_logprobs
        logprobs, entropies = forward(
            self.trainer.module, [s["prompt"] for s in part], [s["ids"] for s in part],
            self.tokenizer.pad_id, self.device, with_entropy=True,
        )  # fmt: skip
        logp, mask = pad_right(logprobs, width)
        old, _ = pad_right([s["old"] for s in part], width)
        if proximal is not None and key not in proximal:
            proximal[key] = logp.detach()
        pg_loss, metrics = ppo_policy_loss(
            old, logp, advantages, mask, grpo.clip_low, grpo.clip_high, grpo.clip_ratio_c,
            grpo.loss_agg_mode, dp, proximal_log_prob=None if proximal is None else proximal[key],
            behaviour_weight_cap=grpo.behaviour_weight_cap,
        )  # fmt: skip
        entropy, _ = pad_right(entropies, width)
        loss = pg_loss
        if grpo.entropy_coef > 0:
            loss = loss - grpo.entropy_coef * agg_loss(entropy, mask, grpo.loss_agg_mode, dp)
        kl = torch.zeros(())
        if grpo.kl_coef > 0:
            ref, _ = pad_right([s["ref"] for s in part], width)
            kl_tokens = kl_penalty(logp, ref, grpo.kl_estimator)
            loss = loss + grpo.kl_coef * agg_loss(kl_tokens, mask, grpo.loss_agg_mode, dp)
            kl = masked_mean(kl_tokens.detach(), mask)
        self.trainer.backward(loss * weight)
        values = [
            loss.item(), pg_loss.item(), metrics.pg_clipfrac.item(), metrics.pg_clipfrac_lower.item(),
            metrics.ppo_kl.item(), masked_mean(entropy.detach(), mask).item(), kl.item(),
        ]  # fmt: skip
        if proximal is not None:
            values += [metrics.behaviour_weight.item(), metrics.behaviour_capped.item()]
        return np.array(values), int(mask.sum().item())

    def _supervised_steps(self, step: int) -> dict[str, float]:
        """The supervised control: as many optimizer steps as an RL update takes, on the warm
        start's data (its teacher's answers), continuing that stream past the warm start."""
        grpo, sft = self.config.grpo, self.config.sft
        per_update = grpo.update_epochs * grpo.minibatches
        lo, hi = even_share(sft.batch_size, self.group_size, self.group_rank)
        losses = []
        for k in range(per_update):
            problems = self.task.train_batch(sft.steps + step * per_update + k, sft.batch_size, stream="sft")
            loss = self._sft_loss(problems[lo:hi])
            self.trainer.step(loss)
            losses.append(loss.item())
        return {"loss": self.group.allreduce(sum(losses) / len(losses)) / self.group_size}

    def push_weights(self, targets: list[tuple[int, str]]) -> dict[str, float]:
        """Send the policy to every ``(world rank, component)`` in ``targets`` (their
        `pull_weights` receives). FSDP2: every actor rank is called; the shards are gathered
        a tensor at a time into one host copy on group rank 0, which sends it."""
        started = time.monotonic()
        tagged = [(rank, (WEIGHTS_TAG, component)) for rank, component in targets]
        if self.config.grpo.train_backend != "fsdp2":
            nbytes = send_weights(self.comm, self.model, tagged)
            return {"seconds": time.monotonic() - started, "bytes": nbytes}
        # group rank 0's host copy, allocated at the first sync and reused; the others only
        # take part in each tensor's all-gather
        full: dict[str, torch.Tensor] = self.__dict__.setdefault("_full_weights", {})
        for name, tensor in full_parameters(self.model):
            if self.group_rank == 0:
                if name not in full:
                    full[name] = torch.empty_like(tensor, device="cpu")
                full[name].copy_(tensor)
        nbytes = send_tensors(self.comm, full, tagged) if self.group_rank == 0 else 0
        return {"seconds": time.monotonic() - started, "bytes": nbytes}


def _combine_micro_metrics(parts: list[tuple[np.ndarray, int]]) -> np.ndarray:
    """A minibatch's metrics from its micro-batches': the two losses (each micro-batch's is
    its share of the minibatch's) summed, the token means weighted by response tokens."""
    tokens = np.array([t for _, t in parts], dtype=float)
    stacked = np.stack([v for v, _ in parts])
    combined = stacked.T @ tokens / max(tokens.sum(), 1.0)
    combined[:2] = stacked[:, :2].sum(axis=0)
    return combined
