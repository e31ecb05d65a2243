"""GPU paths of the math job: the vLLM rollout engine and a CUDA actor. Skipped without CUDA
(and vLLM); they run on a GPU machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import make_tiny_hf_model

torch = pytest.importorskip("torch")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_vllm_rollout_generates_seeded_groups_and_takes_new_weights(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from rlinf_hpc.engines.vllm_engine import VLLMRollout

    model_dir = make_tiny_hf_model(tmp_path / "model")
    engine = VLLMRollout(str(model_dir), "float32", seed=0, gpu_memory_utilization=0.2)
    prompts = [[1, 5, 6, 14, 7, 8, 17]] * 2
    first = engine.generate(prompts, [("k", 0), ("k", 1)], 4, 5, 1.0, eos_id=2)
    again = engine.generate(prompts[:1], [("k", 0)], 4, 5, 1.0, eos_id=2)
    assert [c.ids for c in first[0]] == [c.ids for c in again[0]]  # seeded per prompt group
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    zeroed = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    engine.load_weights(zeroed.items())
    engine.sleep()
    after = engine.generate(prompts[:1], [("k", 0)], 1, 5, 0.0, eos_id=2)
    assert after[0][0].ids  # the engine woke up and generated with the new weights


@needs_cuda
def test_generation_and_logprobs_on_cuda_match_cpu() -> None:
    from rlinf_hpc.config.rl import ModelConfig
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
