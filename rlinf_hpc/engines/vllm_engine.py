"""Rollout on a vLLM engine (GPU only: vLLM has no CPU wheel).

Used by `RolloutWorker` when ``grpo.rollout_backend`` is ``vllm`` (or ``auto`` and vLLM + CUDA
are present and the policy is a Hugging Face directory). Each prompt group is one request with
``n = group_size`` and its own seed (derived from the job seed, step and prompt), so samples do
not depend on how prompts were batched. Weight sync writes the actor's tensors into the engine's
model with ``load_weights`` (vLLM's own loader handles fused/sharded layouts). The engine runs in
this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the rank owns its GPU memory; a light
context switch puts it to sleep (KV cache freed) and wakes it before the next generation.

Not exercised on this project's CPU machines: the GPU test (`tests/test_comm_gpu.py` style)
runs it when vLLM and CUDA are there.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

from rlinf_hpc.engines.generation import Completion, _stable_seed
from rlinf_hpc.errors import UserError


def vllm_available() -> bool:
    """True when vLLM imports and a CUDA device is visible."""
    try:
        import torch
        import vllm  # noqa: F401
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class VLLMRollout:
    """A vLLM ``LLM`` for one rollout rank."""

    def __init__(self, model_path: str, dtype: str, seed: int, gpu_memory_utilization: float = 0.5) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
        except ImportError as exc:
            raise UserError(
                f'grpo.rollout_backend = "vllm" but vLLM does not import ({exc}); install it on '
                'the GPU nodes (pip install vllm) or use rollout_backend = "hf".'
            ) from None
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=True,
        )
        self.asleep = False

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        group_keys: Sequence[Any],
        n: int,
        max_tokens: int,
        temperature: float,
        eos_id: int,
    ) -> list[list[Completion]]:
        """``n`` samples for every prompt; ``group_keys`` seed each prompt's request."""
        from vllm import SamplingParams

        self.wake()
        params = [
            SamplingParams(
                n=n, temperature=temperature, max_tokens=max_tokens, seed=_stable_seed(key) % 2**31
            )
            for key in group_keys
        ]
        prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        groups = []
        for output in outputs:
            group = []
            for sample in output.outputs:
                ids = list(sample.token_ids)
                ended = sample.finish_reason == "stop"
                if ended and (not ids or ids[-1] != eos_id):
                    ids.append(eos_id)
                group.append(Completion(ids, ended))
            groups.append(group)
        return groups

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Write the actor's parameters into the engine's model."""
        self.wake()
        engine = self.llm.llm_engine
        executor = getattr(engine, "model_executor", None)
        worker = getattr(getattr(executor, "driver_worker", None), "worker", None)
        runner = getattr(worker, "model_runner", None)
        model = getattr(runner, "model", None)
        if model is None:
            raise RuntimeError(
                "cannot reach the vLLM model to load weights into (in-process engine expected: "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0); this vLLM version is not supported yet"
            )
        model.load_weights(weights=list(named_tensors))
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Free the KV cache (light switch); weights stay."""
        if not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
