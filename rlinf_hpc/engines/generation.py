"""Generation with transformers ``generate`` and per-token log-probs of given completions.

Sampling is reproducible per sample, independent of batching and of which rank runs it: the
rollout decodes greedily over ``logits / T + g`` where ``g`` is Gumbel noise drawn from a
generator seeded by (seed, sample key, position) — the Gumbel-max trick, an exact sample from
``softmax(logits / T)``. So a fixed seed gives the same samples run to run on CPU, whatever the
micro-batch sizes and load balancing did.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlinf_hpc.engines.tokenizer import Tokenizer


def _stable_seed(*parts: Any) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


class GumbelSampler:
    """A logits processor: ``scores / temperature`` plus per-row, per-position Gumbel noise.

    The noise of a row's ``n``-th new token is drawn from (key, n): the same whatever the
    other rows of the batch, so also whatever width their prompts pad it to."""

    def __init__(self, keys: Sequence[Any], temperature: float, prompt_width: int) -> None:
        self.keys = list(keys)
        self.temperature = temperature
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        position = input_ids.shape[1] - self.prompt_width
        noise = torch.empty(scores.shape, dtype=torch.float32)
        generator = torch.Generator()
        for row, key in enumerate(self.keys):
            generator.manual_seed(_stable_seed(key, position))
            uniform = torch.rand(scores.shape[1], generator=generator).clamp_(1e-10, 1.0 - 1e-7)
            noise[row] = -torch.log(-torch.log(uniform))
        return scores.float() / self.temperature + noise.to(scores.device)


@dataclass
class Completion:
    """Generated token ids (ending with eos when ``ended``) and, where the engine reports them,
    the log-probability of each."""

    ids: list[int]
    ended: bool
    logprobs: list[float] | None = None


def encode_prompts(tokenizer: Tokenizer, prompts: Sequence[str]) -> list[list[int]]:
    prefix = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return [prefix + tokenizer.encode(p) for p in prompts]


def _pad(rows: Sequence[Sequence[int]], pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, attention mask)`` of the rows padded to the longest, on the left or the right."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        where = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, where] = torch.tensor(row, dtype=torch.long)
        mask[i, where] = 1
    return ids, mask


def _prompt_pass(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> Any:
    """The model's output on left-padded prompts, positions counted from each one's first
    token, with a fresh cache of their keys and values; logits of the last position only
    where the model can skip the others (``logits_to_keep``: with a 151 k vocabulary the
    output layer over a whole prompt costs more than a small model's layers)."""
    from transformers import DynamicCache

    keep = {"logits_to_keep": 1} if _takes_logits_to_keep(model) else {}
    return model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        past_key_values=DynamicCache(),
        use_cache=True,
        **keep,
    )


def _takes_logits_to_keep(model: Any) -> bool:
    inner = getattr(model, "module", model)  # DDP / DeepSpeed wrap the model
    return _forward_takes_logits_to_keep(type(inner))


@functools.cache
def _forward_takes_logits_to_keep(model_class: type) -> bool:
    """Per model class, once: every forward of a micro-batch asks."""
    import inspect

    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def _group_rows(rows: Sequence[Sequence[int]]) -> tuple[list[tuple[int, ...]], list[int]]:
    """The distinct rows in first-seen order, and each row's index among them."""
    unique: dict[tuple[int, ...], int] = {}
    group = [unique.setdefault(tuple(r), len(unique)) for r in rows]
    return list(unique), group


@torch.no_grad()
def _shared_prompt_cache(model: Any, prompt_ids: Sequence[Sequence[int]], pad: int, device: str) -> Any:
    """The keys and values of every row's prompt but its last token, computed once per
    distinct prompt (GRPO samples a group of completions of each): a cache for ``generate``,
    which then runs the last prompt token and the new ones. None when no prompt repeats."""
    prompts, group = _group_rows(prompt_ids)
    if len(prompts) == len(prompt_ids) or max(len(p) for p in prompts) < 2:
        return None
    ids, mask = _pad(prompts, pad, left=True)
    cache = _prompt_pass(model, ids[:, :-1].to(device), mask[:, :-1].to(device)).past_key_values
    cache.batch_select_indices(torch.tensor(group, device=device))
    return cache


@torch.no_grad()
def generate(
    model: Any,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    sample_keys: Sequence[Any] | None = None,
    temperature: float = 1.0,
    device: str = "cpu",
) -> list[Completion]:
    """One completion per prompt row: sampled with the row's key, or greedy when keys is None.
    Rows that repeat a prompt (a GRPO group) share its prefill (`_shared_prompt_cache`)."""
    from transformers import LogitsProcessorList

    ids, mask = _pad(prompt_ids, tokenizer.pad_id, left=True)
    processors = LogitsProcessorList()
    if sample_keys is not None:
        processors.append(GumbelSampler(sample_keys, temperature, ids.shape[1]))
    was_training = model.training
    model.eval()
    try:
        cache = _shared_prompt_cache(model, prompt_ids, tokenizer.pad_id, device)
        shared = {} if cache is None else {"past_key_values": cache}
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            **shared,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            logits_processor=processors,
            pad_token_id=tokenizer.pad_id,
            eos_token_id=tokenizer.eos_id,
        )
    finally:
        model.train(was_training)
    completions = []
    for row in out[:, ids.shape[1] :].tolist():
        if tokenizer.eos_id in row:
            completions.append(Completion(row[: row.index(tokenizer.eos_id) + 1], True))
        else:
            completions.append(Completion(row, False))
    return completions


def join_rows(
    prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, list[slice]]:
    """Prompt + completion rows, right-padded: ``(ids, attention mask, spans)`` where span ``i``
    picks, from outputs at positions ``0 .. width - 2``, the positions that predict row ``i``'s
    completion tokens (position t predicts token t + 1)."""
    rows = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
    ids, mask = _pad(rows, pad_id, left=False)
    spans = [slice(len(p) - 1, len(p) - 1 + len(c)) for p, c in zip(prompt_ids, completion_ids, strict=True)]
    return ids, mask, spans


def _at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 logits in fp32 for the log-softmax; fp32 and fp64 as they are."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, spans: list[slice], with_entropy: bool
) -> Any:
    """``log softmax(logits)[target]`` at each row's ``span`` of positions (a list of tensors),
    and with ``with_entropy`` the entropy there too: ``(logprobs, entropies)``."""
    normalizer = torch.logsumexp(logits, dim=-1)
    token_logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - normalizer
    out = [token_logprobs[i, span] for i, span in enumerate(spans)]
    if not with_entropy:
        return out
    from rlinf_hpc.algorithms import entropy_from_logits

    entropy = entropy_from_logits(logits)
    return out, [entropy[i, span] for i, span in enumerate(spans)]


def sequence_logprobs(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    pad_id: int,
    device: str = "cpu",
    with_entropy: bool = False,
) -> Any:
    """Log-probability of every completion token given its prompt (with grad if enabled); with
    ``with_entropy`` also the entropy of the model's next-token distribution at each of those
    positions: ``(logprobs, entropies)``."""
    ids, mask, spans = join_rows(prompt_ids, completion_ids, pad_id)
    # positions before the shortest prompt's last token predict no completion token: where the
    # model can skip their logits (``logits_to_keep``), the output layer runs on the rest only
    first = max(min((len(p) for p in prompt_ids), default=1) - 1, 0) if _takes_logits_to_keep(model) else 0
    keep = {"logits_to_keep": ids.shape[1] - first} if first else {}
    output = model(input_ids=ids.to(device), attention_mask=mask.to(device), **keep)
    logits = _at_least_fp32(output.logits)[:, :-1]  # position first + t predicts token first + t + 1
    spans = [slice(span.start - first, span.stop - first) for span in spans]
    return _token_logprobs(logits, ids[:, first + 1 :].to(logits.device), spans, with_entropy)


def shared_prefix_logprobs(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    pad_id: int,
    device: str = "cpu",
    with_entropy: bool = False,
) -> Any:
    """`sequence_logprobs` for rows that share prompts (GRPO's groups: every sample of a prompt
    beside each other or not): each distinct prompt runs through the model once, and every
    completion then attends to its prompt's keys and values (with grad: the loss reaches the
    prompt's positions through them). A group of 16 completions of 6 tokens after a 7-token
    prompt runs 6 + 16 x 7 positions instead of 16 x 13. Same values as `sequence_logprobs` up
    to float rounding. Rows whose prompts are all distinct, or that have an empty completion,
    take `sequence_logprobs`.

    Hugging Face causal LMs that take ``past_key_values`` and ``position_ids`` (Llama, Qwen2,
    Mistral and the like); ``model`` may be wrapped in DDP (two forward calls, one backward).
    A model training with activation checkpointing keeps no cache (Hugging Face drops it: the
    recompute would write it twice) and takes `sequence_logprobs`.
    """
    prompts, group = _group_rows(prompt_ids)
    inner = getattr(model, "module", model)
    checkpointing = inner.training and getattr(inner, "is_gradient_checkpointing", False)
    if (
        checkpointing
        or len(prompts) == len(prompt_ids)
        or min(len(p) for p in prompts) < 2
        or not all(len(c) for c in completion_ids)
    ):
        return sequence_logprobs(model, prompt_ids, completion_ids, pad_id, device, with_entropy)
    # the cache holds each prompt but its last token (whose logits the prefix pass skips); the
    # second pass runs that token and the completion, so every predicting position's logits
    # come from one matmul of rows x (1 + width), whatever the number of distinct prompts
    prefix_ids, prefix_mask = _pad(prompts, pad_id, left=True)
    prefix_mask = prefix_mask.to(device)
    prefix = _prompt_pass(model, prefix_ids[:, :-1].to(device), prefix_mask[:, :-1])
    index = torch.tensor(group, device=device)
    cache = prefix.past_key_values
    cache.batch_select_indices(index)  # each row's copy of its prompt's keys and values
    ids, mask = _pad(completion_ids, pad_id, left=False)
    ids, mask = ids.to(device), mask.to(device)
    last = prefix_ids[:, -1:].to(device)[index]
    inputs = torch.cat([last, ids], dim=1)
    starts = torch.tensor([len(p) - 1 for p in prompts], device=device)[index]
    rest = model(
        input_ids=inputs,
        attention_mask=torch.cat([prefix_mask[index], mask], dim=1),
        position_ids=starts[:, None] + torch.arange(inputs.shape[1], device=device),
        past_key_values=cache,
        use_cache=False,
    )
    # position 0 (the prompt's last token) predicts each row's first token; position t, t + 1
    logits = _at_least_fp32(rest.logits[:, :-1])
    return _token_logprobs(logits, ids, [slice(0, len(row)) for row in completion_ids], with_entropy)
