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

import torch

from rlinf_hpc.algorithms import group_advantages, grpo_loss
from rlinf_hpc.engines.distributed import (
    broadcast_parameters,
    init_group_process_group,
    release_process_group,
)
from rlinf_hpc.engines.generation import encode_prompts, sequence_logprobs
from rlinf_hpc.engines.training import Trainer
from rlinf_hpc.workers.math_policy import WEIGHTS_TAG, PolicyWorker
from rlinf_hpc.workers.weights import send_weights


class ActorWorker(PolicyWorker):
    def setup(self, threads: int = 1) -> None:
        super().setup(threads)
        self._collected: list[dict[str, Any]] = []
        self._start_training()

    def _start_training(self) -> None:
        grpo = self.config.grpo
        deepspeed = grpo.train_backend == "deepspeed"
        self.distributed = init_group_process_group(self.group, self.device, always=deepspeed)
        broadcast_parameters(self.model)
        clip = grpo.max_grad_norm if deepspeed else None  # DeepSpeed fixes clipping at start
        self.trainer = Trainer(
            self.model, self.device, self.config.sft.lr, grpo.train_backend, grpo.zero_stage, clip
        )

    def switch_state(self) -> Any:
        return self.trainer.switch_state()

    @property  # type: ignore[override]
    def replicated_state(self) -> bool:
        """DDP ranks hold the same model and optimizer; ZeRO ranks hold their own partition."""
        return self.config.grpo.train_backend != "deepspeed"

    def state_dict(self) -> dict[str, Any]:
        """The policy and the RL optimizer (Adam moments, step, learning rate)."""
        return {"model": self.model.state_dict(), "optimizer": self.trainer.optimizer_state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the RL optimizer as the warm start leaves it, then the saved state."""
        self._start_rl()
        self.model.load_state_dict(state["model"])
        self.trainer.load_optimizer_state_dict(state["optimizer"])

    def on_regroup(self) -> None:
        """The actor group changed (re-partition): rebuild data parallelism over the new group;
        weights and optimizer state stay."""
        if self.config.grpo.train_backend == "deepspeed":
            raise RuntimeError(
                "the DeepSpeed actor cannot change its ranks while the job runs (its ZeRO "
                'partitions are fixed); keep the actor\'s ranks, or use train_backend = "ddp"'
            )
        if self.distributed:
            release_process_group()
        self.distributed = init_group_process_group(self.group, self.device)
        broadcast_parameters(self.model)
        optimizer = self.trainer.optimizer
        self.trainer = Trainer(
            self.model, self.device, self.config.grpo.lr, clip_norm=self.config.grpo.max_grad_norm
        )
        self.trainer.optimizer = optimizer  # Adam moments survive the move

    def teardown(self) -> None:
        if self.distributed:
            release_process_group()

    # -- warm start ------------------------------------------------------------------------------
    def _cache_file(self) -> Path | None:
        sft = self.config.sft
        if not sft.cache_dir:
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
                "format": 2,
            },
            sort_keys=True,
        )
        return Path(sft.cache_dir).expanduser() / f"sft-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"

    def warm_start(self) -> dict[str, Any]:
        """Supervised steps on the task's answers (or load them from the cache)."""
        sft = self.config.sft
        started = time.monotonic()
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
        for step in range(sft.steps):
            if sft.stop_at_accuracy is not None and step % sft.check_every == 0 and step:
                accuracy = self._greedy_accuracy(checks)
                if accuracy >= sft.stop_at_accuracy:
                    break
            steps_run = step + 1
            problems = self.task.train_batch(step, sft.batch_size, stream="sft")
            mine = problems[lo:hi]
            loss = self._sft_loss(mine)
            self.trainer.step(loss)
            loss_value = loss.item()
            if (step + 1) % max(1, sft.check_every) == 0 and self.group_rank == 0:
                self.log.info("warm start step %d/%d: loss %.3f", step + 1, sft.steps, loss_value)
        self._start_rl()
        if cache is not None and self.group_rank == 0:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(".tmp")
            torch.save(self.model.state_dict(), tmp)
            tmp.replace(cache)
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
        from rlinf_hpc.engines.generation import generate
        from rlinf_hpc.tasks import score_completion

        mine = problems[self.group_rank :: self.group_size]
        completions = generate(
            self.model,
            self.tokenizer,
            encode_prompts(self.tokenizer, [p.prompt for p in mine]),
            self.config.grpo.max_new_tokens,
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
        prompts = encode_prompts(self.tokenizer, [p.prompt for p in problems])
        targets = [self.tokenizer.encode(p.answer) + [eos] for p in problems]
        logprobs = sequence_logprobs(
            self.trainer.module, prompts, targets, self.tokenizer.pad_id, self.device
        )
        return -torch.cat(logprobs).mean()

    # -- GRPO ----------------------------------------------------------------------------------
    def collect(self, batch: list[dict[str, Any]]) -> None:
        """The actor stage: keep this micro-batch's groups for the update."""
        self._collected.extend(batch)

    def update(self) -> dict[str, Any]:
        """One GRPO update on every group collected by any actor rank this step."""
        grpo = self.config.grpo
        started = time.monotonic()
        groups = [g for share in self.group.allgather(self._collected) for g in share]
        self._collected = []
        groups.sort(key=lambda g: g["uid"])
        rewards = torch.tensor([g["rewards"] for g in groups], dtype=torch.float32)
        advantages = group_advantages(rewards).flatten()
        samples = [
            (
                g["prompt_ids"],
                ids,
                g["old_logprobs"][j],
                g.get("ref_logprobs", [None] * len(g["completions"]))[j],
            )
            for g in groups
            for j, ids in enumerate(g["completions"])
        ]
        lo, hi = even_share(len(samples), self.group_size, self.group_rank)
        mine, my_adv = samples[lo:hi], advantages[lo:hi]
        stats = []
        for _ in range(grpo.update_epochs):
            for m in range(grpo.minibatches):
                part = slice(*even_share(len(mine), grpo.minibatches, m))
                chunk = mine[part]
                logprobs = sequence_logprobs(
                    self.trainer.module,
                    [s[0] for s in chunk],
                    [s[1] for s in chunk],
                    self.tokenizer.pad_id,
                    self.device,
                )
                ref = [s[3] for s in chunk] if grpo.kl_coef > 0 else None
                loss, stat = grpo_loss(
                    logprobs, [s[2] for s in chunk], my_adv[part], grpo.clip_eps, ref, grpo.kl_coef
                )
                grad_norm = self.trainer.step(loss)
                stats.append((stat, grad_norm))
        correct = [c for g in groups for c in g["correct"]]
        formed = [w for g in groups for w in g["well_formed"]]
        return {
            "reward": rewards.mean().item(),
            "sample_accuracy": sum(correct) / len(correct),
            "well_formed": sum(formed) / len(formed),
            "loss": sum(s.loss for s, _ in stats) / len(stats),
            "kl": sum(s.kl for s, _ in stats) / len(stats),
            "clip_fraction": sum(s.clip_fraction for s, _ in stats) / len(stats),
            "grad_norm": sum(n for _, n in stats) / len(stats),
            "tokens": sum(g["tokens"] for g in groups),
            "groups": len(groups),
            "update_s": time.monotonic() - started,
        }

    def push_weights(self, targets: list[tuple[int, str]]) -> dict[str, float]:
        """Send the policy to every ``(world rank, component)`` in ``targets`` (their
        `pull_weights` receives)."""
        started = time.monotonic()
        tagged = [(rank, (WEIGHTS_TAG, component)) for rank, component in targets]
        nbytes = send_weights(self.comm, self.model, tagged)
        return {"seconds": time.monotonic() - started, "bytes": nbytes}


def even_share(total: int, parts: int, index: int) -> tuple[int, int]:
    """``[lo, hi)`` of part ``index`` when ``total`` items are split into ``parts`` contiguous
    parts whose sizes differ by at most one (manual placements are checked to divide evenly;
    a split chosen by ``auto`` may not).

    >>> [even_share(10, 3, i) for i in range(3)]
    [(0, 4), (4, 7), (7, 10)]
    """
    base, extra = divmod(total, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)
