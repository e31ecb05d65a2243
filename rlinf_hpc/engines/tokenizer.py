"""Tokenizers behind one small interface: a character-level one made locally for tiny models,
and an adapter for a Hugging Face tokenizer loaded from a local model directory.

>>> tok = CharTokenizer.for_texts(["12+3=", "15"])
>>> tok.decode(tok.encode("12+3=15"))
'12+3=15'
>>> tok.pad_id, tok.bos_id, tok.eos_id
(0, 1, 2)
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

SPECIALS = ("<pad>", "<bos>", "<eos>")
#: Characters every character-level vocabulary holds (arithmetic and answers).
BASE_CHARS = "0123456789+-*=., "


class Tokenizer(Protocol):
    pad_id: int
    bos_id: int | None
    eos_id: int
    vocab_size: int
    #: Jinja chat template (None: the tokenizer has none; prompts are plain text).
    chat_template: str | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def render_chat(self, messages: list[dict[str, str]]) -> str: ...


class CharTokenizer:
    """One id per character; ids 0/1/2 are pad/bos/eos."""

    pad_id, bos_id, eos_id = 0, 1, 2
    chat_template = None

    def __init__(self, chars: str) -> None:
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer needs distinct characters")
        self.chars = chars
        self._ids = {c: i + len(SPECIALS) for i, c in enumerate(chars)}
        self.vocab_size = len(SPECIALS) + len(chars)

    @classmethod
    def for_texts(cls, texts: Iterable[str]) -> CharTokenizer:
        """The base characters plus every other character that occurs in ``texts``."""
        extra = sorted({c for text in texts for c in text} - set(BASE_CHARS))
        return cls(BASE_CHARS + "".join(extra))

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the tokenizer's vocabulary") from None

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.chars[i - len(SPECIALS)] for i in ids if i >= len(SPECIALS))

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        raise ValueError("the character tokenizer has no chat template")

    def save(self, directory: Path) -> None:
        (directory / "char_tokenizer.json").write_text(json.dumps({"chars": self.chars}), encoding="utf-8")

    @classmethod
    def load(cls, directory: Path) -> CharTokenizer:
        return cls(json.loads((directory / "char_tokenizer.json").read_text(encoding="utf-8"))["chars"])


class HFTokenizer:
    """A Hugging Face tokenizer (from a local directory) behind the `Tokenizer` interface."""

    def __init__(self, tokenizer: Any) -> None:
        self.inner = tokenizer
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer defines no eos token")
        self.eos_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id)
        self.bos_id = None if tokenizer.bos_token_id is None else int(tokenizer.bos_token_id)
        self.vocab_size = len(tokenizer)
        self.chat_template = getattr(tokenizer, "chat_template", None) or None

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The messages through the tokenizer's chat template, ending with the assistant's
        turn opened (``add_generation_prompt``)."""
        return str(self.inner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    def encode(self, text: str) -> list[int]:
        return list(self.inner.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int]) -> str:
        return self.inner.decode(list(ids), skip_special_tokens=True)
