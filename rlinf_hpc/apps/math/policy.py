"""Workers of the math GRPO job that hold or read the policy: rollout, inference, reward.

Items travelling through the pipeline are prompt groups (dicts): the flow feeds
``{"uid", "step", "prompt", "answer"}``; rollout adds ``prompt_ids``, ``completions`` (token ids,
ending with eos when ``ended``) for ``group_size`` samples; reward adds ``rewards``, ``correct``,
``well_formed``; inference adds ``old_logprobs`` (and ``ref_logprobs`` with a KL penalty).
"""

from __future__ import annotations

import copy
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rlinf_hpc.apps.math.tasks import make_task, score_completion, vocabulary_texts
from rlinf_hpc.apps.math.tasks.prompts import PromptFormat
from rlinf_hpc.config import Config
from rlinf_hpc.engines.generation import generate, shared_prefix_logprobs
from rlinf_hpc.engines.model import build_policy, count_parameters, load_tokenizer
from rlinf_hpc.engines.tokenizer import CharTokenizer, Tokenizer
from rlinf_hpc.errors import UserError
from rlinf_hpc.log import get_logger
from rlinf_hpc.runtime.progress import Progress
from rlinf_hpc.workers.base import Worker
from rlinf_hpc.workers.sharding import group_micro_batches, token_micro_batches
from rlinf_hpc.workers.weights import receive_weights, take_weights

log = get_logger("rollout")

#: Data-plane tag of weight-sync messages.
WEIGHTS_TAG = "policy-weights"


def _config(worker: Worker) -> Config:
    if worker.job_config is None:
        raise RuntimeError(f"{type(worker).__name__} needs the job config (run it inside a job)")
    return worker.job_config


class PolicyWorker(Worker):
    """Builds the task and the policy (same initial weights on every rank for a seed)."""

    def setup(self, threads: int = 1) -> None:
        torch.set_num_threads(threads)
        config = _config(self)
        self.config = config
        self.task = make_task(config.task, config.job.seed)
        self.prompts = PromptFormat.of_task(config.task)
        texts = vocabulary_texts(config.task, self.task)
        self.model, self.tokenizer = build_policy(config.model, texts, config.job.seed)
        self.model.to(self.device)
        self.log.info(
            "policy %s with %.2f M parameters on %s",
            type(self.model).__name__, count_parameters(self.model) / 1e6, self.device,
        )  # fmt: skip

    def switch_state(self) -> Any:
        return self.model

    def parameter_digest(self) -> str:
        """sha256 of every parameter (tests: synced workers hold the actor's weights)."""
        return parameter_digest(self.model)

    def pull_weights(self, source: int) -> dict[str, float]:
        """Take the actor's weights (sent by `ActorWorker.push_weights` on world rank
        ``source``) into this rank's policy, in place."""
        started = time.monotonic()
        nbytes = receive_weights(self.comm, self.model, source, (WEIGHTS_TAG, self.component))
        return {"seconds": time.monotonic() - started, "bytes": nbytes}


def _use_vllm(config: Config, device: str) -> bool:
    """Whether the rollout runs on vLLM (``rollout_backend``; `UserError` if it must and cannot).
    ``auto`` takes vLLM when a build for this rank's device is installed and serves the model
    directory in ``model.path`` (the built-in tiny model stays on transformers)."""
    backend = config.grpo.rollout_backend
    if backend == "hf":
        return False
    from rlinf_hpc.engines import vllm_engine

    if backend == "vllm":
        vllm_engine.check_vllm_install(device)
        return True
    wanted = "cpu" if device == "cpu" else "gpu"
    if not config.model.path or vllm_engine.vllm_build() != wanted:
        return False
    try:
        vllm_engine.check_vllm_install(device)
        vllm_engine.check_servable(config.model.path, device == "cpu")
    except UserError as exc:
        log.info("rollout_backend = auto: transformers, not vLLM (%s)", exc)
        return False
    return True


def _vllm_model_dir(model: Any, tokenizer: Tokenizer, rank: int) -> str:
    """Save the built-in policy as a Hugging Face directory vLLM can load (node-local temp)."""
    directory = Path(tempfile.mkdtemp(prefix=f"rlinf-vllm-r{rank}-"))
    model.generation_config.eos_token_id = tokenizer.eos_id
    model.save_pretrained(directory)
    return str(directory)


class RolloutWorker(PolicyWorker):
    """Samples ``group_size`` completions per prompt; greedy held-out evaluation. Generates with
    transformers, or with a vLLM engine on GPU ranks (`grpo.rollout_backend`)."""

    def setup(self, threads: int = 1) -> None:
        config = _config(self)
        self.engine: Any = None
        self.scratch: str | None = None
        if _use_vllm(config, self.device):
            from rlinf_hpc.engines.vllm_engine import VLLMRollout

            torch.set_num_threads(threads)
            self.config = config
            self.task = make_task(config.task, config.job.seed)
            self.prompts = PromptFormat.of_task(config.task)
            self.model = None
            if config.model.path:
                model_dir = config.model.path
                self.tokenizer = load_tokenizer(config.model.path)
            else:  # the built-in tiny model: vLLM loads it from a directory
                texts = vocabulary_texts(config.task, self.task)
                model, self.tokenizer = build_policy(config.model, texts, config.job.seed)
                model_dir = self.scratch = _vllm_model_dir(model, self.tokenizer, self.rank)
                del model
            started = time.monotonic()
            self.engine = VLLMRollout(
                model_dir,
                config.model.dtype,
                config.job.seed,
                device=self.device,
                gpu_memory_utilization=config.grpo.vllm_gpu_memory_utilization,
                kv_cache_gib=config.grpo.vllm_kv_cache_gib,
            )
            self.log.info(
                "rollout on vLLM (%s, %s) started in %.1f s",
                config.model.path or "built-in model", self.device, time.monotonic() - started,
            )  # fmt: skip
        else:
            super().setup(threads)
        self.generated_tokens = 0

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None

    def switch_state(self) -> Any:
        return self.model  # a vLLM engine is not moved; a light switch puts it to sleep

    def release_caches(self) -> None:
        if self.engine is not None:
            self.engine.sleep()

    def pull_weights(self, source: int) -> dict[str, float]:
        if self.engine is None:
            return super().pull_weights(source)
        started = time.monotonic()
        state = take_weights(self.comm, source, (WEIGHTS_TAG, self.component))
        self.engine.load_weights(state.items())
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        return {"seconds": time.monotonic() - started, "bytes": nbytes}

    def _sample(self, prompt_ids: list[list[int]], batch: list[dict[str, Any]]) -> list[Any]:
        grpo = self.config.grpo
        seed = self.config.job.seed
        if self.engine is not None:
            keys = [(seed, item["step"], item["uid"]) for item in batch]
            groups = self.engine.generate(
                prompt_ids,
                keys,
                grpo.group_size,
                grpo.max_response_length,
                grpo.temperature,
                self.tokenizer.eos_id,
            )
            return [c for group in groups for c in group]
        rows = [ids for ids in prompt_ids for _ in range(grpo.group_size)]
        keys = [(seed, item["step"], item["uid"], j) for item in batch for j in range(grpo.group_size)]
        size = grpo.group_size if grpo.batch_invariant else len(rows)  # a prompt's group alone
        return [
            completion
            for start in range(0, len(rows), size)
            for completion in generate(
                self.model,
                self.tokenizer,
                rows[start : start + size],
                grpo.max_response_length,
                keys[start : start + size],
                grpo.temperature,
                self.device,
            )  # fmt: skip
        ]

    def _greedy(self, prompt_ids: list[list[int]]) -> list[Any]:
        max_new = self.config.grpo.max_response_length
        if self.engine is not None:
            keys = [("eval", i) for i in range(len(prompt_ids))]
            groups = self.engine.generate(prompt_ids, keys, 1, max_new, 0.0, self.tokenizer.eos_id)
            return [group[0] for group in groups]
        return generate(self.model, self.tokenizer, prompt_ids, max_new, device=self.device)

    def generate(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        grpo = self.config.grpo
        prompt_ids = self.prompts.encode([item["prompt"] for item in batch], self.tokenizer)
        completions = self._sample(prompt_ids, batch)
        out = []
        for k, item in enumerate(batch):
            group = completions[k * grpo.group_size : (k + 1) * grpo.group_size]
            self.generated_tokens += sum(len(c.ids) for c in group)
            out.append(
                {
                    **item,
                    "prompt_ids": prompt_ids[k],
                    "completions": [c.ids for c in group],
                    "ended": [c.ended for c in group],
                    "tokens": sum(len(c.ids) for c in group),
                }
            )
        return out

    def evaluate(self, problems: list[tuple[int, Any, str]]) -> dict[str, Any]:
        """Greedy answers to held-out ``(uid, prompt, answer)`` problems: how many are right;
        the first examples with the prompt as the model read it. Generates in chunks of about
        ``grpo.micro_batch_tokens`` (prompt + response) tokens, its progress shown after each."""
        correct, examples = 0, []
        encoded = self.prompts.encode([p for _, p, _ in problems], self.tokenizer)
        longest = max((len(ids) for ids in encoded), default=1) + self.config.grpo.max_response_length
        budget = self.config.grpo.micro_batch_tokens
        batch_size = 256 if self.engine is not None or budget == 0 else max(1, min(256, budget // longest))
        progress = Progress("evaluate", len(problems), "problems")
        for start in range(0, len(problems), batch_size):
            chunk = problems[start : start + batch_size]
            completions = self._greedy(encoded[start : start + batch_size])
            progress.advance(len(chunk), tokens=sum(len(c.ids) for c in completions))
            for (uid, prompt, answer), completion in zip(chunk, completions, strict=True):
                text = self.tokenizer.decode(completion.ids)
                ok = score_completion(text, answer, completion.ended, 0.0).correct
                correct += ok
                if len(examples) < 3:
                    rendered = self.prompts.render(prompt, self.tokenizer)
                    examples.append(
                        {"uid": uid, "prompt": rendered, "answer": answer, "completion": text, "ok": ok}
                    )
        progress.close()
        return {"correct": correct, "total": len(problems), "examples": examples}

    def tokens_generated(self) -> int:
        return self.generated_tokens


class RewardWorker(Worker):
    """Scores every completion with the rule-based verifier (no model)."""

    def setup(self) -> None:
        config = _config(self)
        self.format_reward = config.task.format_reward
        if config.model.path:
            self.tokenizer: Tokenizer = load_tokenizer(config.model.path)
        else:
            task = make_task(config.task, config.job.seed)
            self.tokenizer = CharTokenizer.for_texts(vocabulary_texts(config.task, task))

    def score(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for item in batch:
            scores = [
                score_completion(self.tokenizer.decode(ids), item["answer"], ended, self.format_reward)
                for ids, ended in zip(item["completions"], item["ended"], strict=True)
            ]
            out.append(
                {
                    **item,
                    "rewards": [s.reward for s in scores],
                    "correct": [s.correct for s in scores],
                    "well_formed": [s.well_formed for s in scores],
                }
            )
        return out


class InferenceWorker(PolicyWorker):
    """Old-policy log-probs (the weights the rollout sampled with) and, with a KL penalty, the
    reference (warm-started) policy's."""

    def setup(self, threads: int = 1) -> None:
        super().setup(threads)
        self.reference: Any = None

    def set_reference(self) -> None:
        """Freeze a copy of the current weights as the reference policy."""
        self.reference = copy.deepcopy(self.model).eval()
        for p in self.reference.parameters():
            p.requires_grad_(False)

    def switch_state(self) -> Any:
        return self.model if self.reference is None else torch.nn.ModuleList([self.model, self.reference])

    def state_dict(self) -> dict[str, Any] | None:
        """The reference policy (the current one is synced from the actor after a resume)."""
        return None if self.reference is None else {"reference": self.reference.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.set_reference()
        self.reference.load_state_dict(state["reference"])

    @torch.no_grad()
    def logprobs(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        prompts = [item["prompt_ids"] for item in batch for _ in item["completions"]]
        completions = [ids for item in batch for ids in item["completions"]]
        groups = [len(item["completions"]) for item in batch]
        old = self._micro_batched(self.model, prompts, completions, groups)
        ref = None
        if self.config.grpo.kl_coef > 0:
            if self.reference is None:
                raise RuntimeError("set_reference() must run before log-probs with a KL penalty")
            ref = self._micro_batched(self.reference, prompts, completions, groups)
        out, k = [], 0
        for item in batch:
            n = len(item["completions"])
            extra = {"old_logprobs": old[k : k + n]}
            if ref is not None:
                extra["ref_logprobs"] = ref[k : k + n]
            out.append({**item, **extra})
            k += n
        return out

    def _micro_batched(
        self, model: Any, prompts: list[list[int]], completions: list[list[int]], groups: list[int]
    ) -> list[torch.Tensor]:
        """Per-token log-probs of every row, in forwards of at most ``grpo.micro_batch_tokens``
        padded tokens (the actor's budget: a 151 k vocabulary's logits dominate the memory);
        with ``grpo.batch_invariant`` each prompt's group (``groups``: their sizes, in row order)
        in forwards of its own."""
        grpo = self.config.grpo
        lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
        out: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
        if grpo.batch_invariant:
            batches = group_micro_batches(groups, lengths, grpo.micro_batch_tokens)
        else:
            batches = token_micro_batches(lengths, grpo.micro_batch_tokens)
        for index in batches:
            rows = shared_prefix_logprobs(
                model, [prompts[i] for i in index], [completions[i] for i in index],
                self.tokenizer.pad_id, self.device,
            )  # fmt: skip
            for i, row in zip(index, rows, strict=True):
                out[i] = row.cpu()
        return out


def parameter_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter's bytes, in name order."""
    import hashlib

    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
