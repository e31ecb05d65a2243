"""The policy model: a tiny Qwen2 built from `ModelConfig` (no download), or a causal LM loaded
from a local Hugging Face directory. `check_model_dir` validates a directory before any rank
loads it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from rlinf_hpc.config.section import Section
from rlinf_hpc.engines.tokenizer import CharTokenizer, HFTokenizer, Tokenizer
from rlinf_hpc.errors import UserError

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub: models come from disk


class ModelConfig(Section):
    """[model]: the policy. A local Hugging Face directory, or a tiny Qwen2 built from this table."""

    path: str = Field(
        "",
        description="Local Hugging Face model directory (a causal LM with its tokenizer). Empty: "
        "build a tiny Qwen2 with a character-level tokenizer from the fields below.",
    )
    hidden_size: int = Field(128, ge=8, description="Tiny model: hidden size.")
    num_layers: int = Field(4, ge=1, description="Tiny model: transformer layers.")
    num_heads: int = Field(4, ge=1, description="Tiny model: attention heads.")
    intermediate_size: int = Field(384, ge=8, description="Tiny model: MLP width.")
    max_positions: int = Field(64, ge=8, description="Tiny model: longest prompt + completion.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype (float32 on CPU)."
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Activation checkpointing in the actor's (and critic's) training forward: "
        "keep only each layer's input and recompute the rest in the backward (about a third "
        "more compute; activation memory per layer boundary instead of per operation).",
    )

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_heads "
                f"({self.num_heads})"
            )
        return self


def check_model_dir(path: str) -> Path:
    """The directory, if it holds a causal LM config; else `UserError` saying what is wrong."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise UserError(
            f"model.path = '{path}' is not a directory. Give a local Hugging Face model directory "
            "(config.json, weights, tokenizer), e.g. one made with `huggingface-cli download`, or "
            "leave model.path empty to build the tiny model."
        )
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise UserError(
            f"model.path = '{path}' has no config.json; it is not a Hugging Face model directory."
        )
    try:
        architectures = json.loads(config_file.read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"model.path = '{path}': config.json is unreadable ({exc}).") from None
    if not any(str(a).endswith("ForCausalLM") for a in architectures):
        raise UserError(
            f"model.path = '{path}' holds a {', '.join(architectures) or 'model without architectures'}, "
            "not a causal language model (an architecture ending in ForCausalLM)."
        )
    weights = [p for pattern in WEIGHT_FILES for p in directory.glob(pattern)]
    if not weights:
        raise UserError(
            f"model.path = '{path}' has a config.json but no weights ({', '.join(WEIGHT_FILES)}): "
            "the download or copy is incomplete. Fetch the weights into the directory, or point "
            "model.path at a complete one."
        )
    return directory


#: Weight files a Hugging Face model directory holds (one of them, or shards with an index).
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json")


def load_tokenizer(path: str) -> HFTokenizer:
    """The tokenizer of a model directory (checked by `check_model_dir` first)."""
    from transformers import AutoTokenizer

    directory = check_model_dir(path)
    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(directory, local_files_only=True))
    except (OSError, ValueError) as exc:
        raise UserError(
            f"model.path = '{path}': its tokenizer does not load ({type(exc).__name__}: {exc}). "
            "A model directory needs tokenizer.json (or the files its tokenizer class reads) "
            "and tokenizer_config.json beside config.json."
        ) from None


def text_config(path: str) -> dict[str, Any]:
    """The language model's part of a model directory's config.json (its ``text_config`` in a
    multimodal one), for shapes: hidden size, layers, vocabulary."""
    config = json.loads((Path(path).expanduser() / "config.json").read_text(encoding="utf-8"))
    return dict(config.get("text_config") or config)


def check_tokenizer_fits(path: str, tokenizer: Tokenizer) -> None:
    """`UserError` when the tokenizer has ids the model's embedding has no row for (a
    tokenizer from another model): they would index past the table on the first prompt."""
    rows = text_config(path).get("vocab_size")
    if rows is not None and tokenizer.vocab_size > int(rows):
        raise UserError(
            f"model.path = '{path}': the tokenizer has {tokenizer.vocab_size} tokens but the "
            f"model's embedding has {rows} rows (config.json vocab_size): ids past {int(rows) - 1} "
            "have no embedding. The tokenizer files belong to another model; copy the tokenizer "
            "that came with these weights into the directory."
        )


def tiny_qwen2(config: ModelConfig, tokenizer: Tokenizer, seed: int) -> Any:
    """A freshly initialized Qwen2ForCausalLM sized by ``config``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    qwen = Qwen2Config(
        vocab_size=tokenizer.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=config.max_positions,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(qwen).to(getattr(torch, config.dtype))


def build_policy(config: ModelConfig, texts: list[str], seed: int) -> tuple[Any, Tokenizer]:
    """(model, tokenizer): loaded from ``config.path`` or tiny (same initial weights for a seed)."""
    import torch

    if config.path:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a bar per rank, interleaved: the log line says it
        directory = check_model_dir(config.path)
        tokenizer = load_tokenizer(config.path)
        model = AutoModelForCausalLM.from_pretrained(
            directory, local_files_only=True, dtype=getattr(torch, config.dtype)
        )
        return model, tokenizer
    tokenizer = CharTokenizer.for_texts(texts)
    return tiny_qwen2(config, tokenizer, seed), tokenizer


def count_parameters(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())
