"""GPU paths of the math job: generation and log-probs on CUDA. Skipped without CUDA. (The vLLM
engine's tests, tests/test_vllm.py, run on whichever platform the installed vLLM build targets:
the same code path on CPU and GPU.)"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_generation_and_logprobs_on_cuda_match_cpu() -> None:
    from rlinf_hpc.apps.math.config import ModelConfig
    from rlinf_hpc.engines.generation import encode_prompts, generate, sequence_logprobs
    from rlinf_hpc.engines.model import build_policy

    model, tokenizer = build_policy(
        ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), [], 0
    )
    prompts = encode_prompts(tokenizer, ["12+34=", "56+78="])
    cpu = generate(model, tokenizer, prompts, 4, [("a", 0), ("a", 1)], 1.0)
    (lp_cpu,) = sequence_logprobs(model, prompts[:1], [cpu[0].ids], tokenizer.pad_id)
    model = model.to("cuda")
    (lp_gpu,) = sequence_logprobs(model, prompts[:1], [cpu[0].ids], tokenizer.pad_id, "cuda")
    assert torch.allclose(lp_cpu, lp_gpu.cpu(), atol=1e-4)
