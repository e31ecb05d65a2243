"""The actor's token budget: a minibatch cut into micro-batches (gradients accumulated) takes
the same optimizer step as one forward over all of it, in float64, for every loss
aggregation; and the packing keeps each micro-batch within its budget."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from rlinf_hpc.algorithms import DataParallelScale
from rlinf_hpc.apps.math.actor import ActorWorker
from rlinf_hpc.apps.math.config import GRPOConfig, ModelConfig
from rlinf_hpc.engines.model import tiny_qwen2
from rlinf_hpc.engines.tokenizer import CharTokenizer
from rlinf_hpc.engines.training import Trainer
from rlinf_hpc.workers.sharding import token_micro_batches

torch.set_num_threads(1)


def _samples(tokenizer: CharTokenizer) -> list[dict]:
    """Three prompts, two samples each, responses of different lengths (one fully masked out
    by a zero advantage would still count: none here)."""
    generator = torch.Generator().manual_seed(0)
    prompts = [tokenizer.encode(p) for p in ("12+3=", "7+45=", "100+2=")]
    samples = []
    for uid, prompt in enumerate(prompts):
        for j, length in enumerate((2 + uid, 4 - uid)):
            ids = torch.randint(3, tokenizer.vocab_size, (length,), generator=generator).tolist()
            old = -torch.rand(length, generator=generator, dtype=torch.float64) - 0.5
            ref = old - 0.1 * torch.rand(length, generator=generator, dtype=torch.float64)
            samples.append({"prompt": [1, *prompt], "ids": ids, "old": old, "ref": ref, "uid": uid, "j": j})
    return samples


def _float64(model: torch.nn.Module) -> torch.nn.Module:
    """The model in float64 throughout: Hugging Face's RMSNorm computes in float32 whatever
    the input (rounding that depends on how rows are grouped in the backward), so each is
    replaced by torch's RMSNorm with its weight."""
    model = model.double()
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RMSNorm"):
            norm = torch.nn.RMSNorm(module.weight.shape, eps=module.variance_epsilon, dtype=torch.float64)
            norm.weight.data.copy_(module.weight.data)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, norm)
    return model


def _step(budget: int, agg: str, model: torch.nn.Module, samples: list[dict]) -> tuple[dict, list]:
    """One `_minibatch_step` of an actor made of the real pieces (config, trainer, tokenizer)."""
    grpo = GRPOConfig(
        micro_batch_tokens=budget, loss_agg_mode=agg, max_response_length=6, kl_coef=0.1,
        entropy_coef=0.01, group_size=2,
    )  # fmt: skip
    actor = ActorWorker.__new__(ActorWorker)
    actor.config = SimpleNamespace(grpo=grpo)
    actor.tokenizer = SimpleNamespace(pad_id=0)
    actor.device = "cpu"
    actor.trainer = Trainer(model, "cpu", lr=1e-3, clip_norm=None)
    generator = torch.Generator().manual_seed(1)
    advantages = torch.randn(len(samples), 6, generator=generator, dtype=torch.float64)
    tokens = sum(len(s["ids"]) for s in samples)
    dp = DataParallelScale(float(tokens), float(len(samples)), 1)
    metrics = actor._minibatch_step(samples, advantages, dp, None, 0)
    grads = [p.grad.clone() for p in model.parameters()]
    return {"metrics": metrics}, grads


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_one_sequence_per_micro_batch_takes_the_whole_minibatchs_step(agg: str) -> None:
    tokenizer = CharTokenizer.for_texts(["0123456789+="])
    config = ModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    model = _float64(tiny_qwen2(config, tokenizer, seed=0))
    samples = _samples(tokenizer)
    whole, whole_grads = _step(0, agg, copy.deepcopy(model), samples)
    split, split_grads = _step(1, agg, copy.deepcopy(model), samples)  # every sequence alone
    assert len(token_micro_batches([len(s["prompt"]) + len(s["ids"]) for s in samples], 1)) == 6
    for a, b in zip(whole_grads, split_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # the losses are sums of the micro-batches' shares, the other metrics token-weighted means
    # (of masked means whose denominators carry a 1e-8 guard: ~1e-9 apart, relative)
    torch.testing.assert_close(
        torch.as_tensor(whole["metrics"]), torch.as_tensor(split["metrics"]), rtol=1e-7, atol=1e-12
    )
    assert any(g.abs().sum() > 0 for g in whole_grads)  # the step did move the policy


def test_packing_respects_the_budget_and_places_every_sequence_once() -> None:
    lengths = [7, 3, 12, 5, 5, 9, 1, 30]
    for budget in (10, 16, 24, 64):
        batches = token_micro_batches(lengths, budget)
        assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
        for batch in batches:
            padded = max(lengths[i] for i in batch) * len(batch)
            assert padded <= budget or len(batch) == 1  # a too-long sequence goes alone
    assert token_micro_batches(lengths, 0) == [list(range(len(lengths)))]
    assert token_micro_batches([], 8) == []
