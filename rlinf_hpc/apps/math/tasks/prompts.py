"""From a problem to the token ids the policy sees: prompt template, chat template, length.

A problem's prompt is a question (text) or, from veRL's Parquet layout, a list of chat
messages. A question goes through ``task.prompt_template`` (its ``{question}`` placeholder)
into one user message; ``task.system_prompt`` (when set) goes before it as a system message;
the tokenizer's chat template renders the messages when ``task.chat_template`` says so
(``auto``: when the tokenizer has one), else the messages' contents are joined by newlines.
Prompts longer than ``task.max_prompt_length`` tokens are an error or cut from the ``left`` or
``right`` (``task.truncation``). Rollout, the held-out evaluation and the warm start all
encode through `PromptFormat`, so the model sees one format everywhere.

>>> from rlinf_hpc.engines.tokenizer import CharTokenizer
>>> tok = CharTokenizer.for_texts(["Q:A"])
>>> fmt = PromptFormat("Q: {question} A:", "auto", "", 8, "left")
>>> fmt.render("1+2=", tok)
'Q: 1+2= A:'
>>> ids = fmt.encode(["1+2="], tok)[0]  # bos, then the last 7 characters
>>> ids[0] == tok.bos_id, tok.decode(ids)
(True, '1+2= A:')
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rlinf_hpc.engines.tokenizer import Tokenizer
from rlinf_hpc.errors import UserError

#: veRL's GSM8K instruction (examples/data_preprocess/gsm8k.py), after the question.
GSM8K_TEMPLATE = '{question} Let\'s think step by step and output the final answer after "####".'
#: Generated arithmetic: the bare expression (the tiny model's character vocabulary).
BARE_TEMPLATE = "{question}"

#: A prompt as the data holds it: a question, or chat messages ``[{"role", "content"}, ...]``.
RawPrompt = str | list[dict[str, str]]


def check_template(template: str) -> str:
    """``template`` if it has exactly the ``{question}`` placeholder; else `UserError`."""
    try:
        rendered = template.format(question="\x00")
    except (KeyError, IndexError, ValueError) as exc:
        raise UserError(
            f"task.prompt_template = {template!r} cannot be filled in ({type(exc).__name__}: {exc}): "
            "it may hold only the {question} placeholder; write a literal brace as {{ or }}."
        ) from None
    if "\x00" not in rendered:
        raise UserError(
            f"task.prompt_template = {template!r} has no {{question}} placeholder, so every prompt "
            "would be the same text. Put {question} where the problem goes, e.g. "
            f"{GSM8K_TEMPLATE!r}."
        )
    return template


@dataclass(frozen=True)
class PromptFormat:
    """How raw prompts become token ids (see the module docstring)."""

    template: str
    chat_template: Literal["auto", "never", "always"]
    system_prompt: str
    max_length: int
    truncation: Literal["error", "left", "right"]

    @classmethod
    def of_task(cls, task: Any) -> PromptFormat:
        """The format ``[task]`` asks for (the template's default follows ``task.kind``)."""
        template = task.prompt_template
        if template is None:
            template = BARE_TEMPLATE if task.kind == "arithmetic" else GSM8K_TEMPLATE
        return cls(
            check_template(template), task.chat_template, task.system_prompt,
            task.max_prompt_length, task.truncation,
        )  # fmt: skip

    def texts(self) -> list[str]:
        """Text the format adds to every prompt (a character vocabulary must cover it)."""
        return [self.template.replace("{question}", ""), self.system_prompt]

    def messages(self, prompt: RawPrompt) -> list[dict[str, str]]:
        """The chat messages of ``prompt``: the system prompt (unless the data has one), then
        the data's messages or the templated question as a user message."""
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": self.template.format(question=prompt)}]
        else:
            messages = [dict(m) for m in prompt]
        if self.system_prompt and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def uses_chat(self, tokenizer: Tokenizer) -> bool:
        has = getattr(tokenizer, "chat_template", None) is not None
        if self.chat_template == "always" and not has:
            raise UserError(
                'task.chat_template = "always" but the tokenizer has no chat template (a base '
                'model\'s, or the built-in character tokenizer). Use "auto" (templates when the '
                'tokenizer has one) or "never", or point model.path at an instruct model.'
            )
        return has and self.chat_template != "never"

    def render(self, prompt: RawPrompt, tokenizer: Tokenizer) -> str:
        """The prompt's text as the model reads it (chat template applied or not)."""
        messages = self.messages(prompt)
        if self.uses_chat(tokenizer):
            return tokenizer.render_chat(messages)  # type: ignore[attr-defined]
        return "\n".join(m["content"] for m in messages)

    def encode(self, prompts: Sequence[RawPrompt], tokenizer: Tokenizer) -> list[list[int]]:
        """Token ids of each prompt (bos first when the tokenizer has one and the chat
        template did not write it), cut to ``max_length`` or `UserError` (``error``)."""
        rows = []
        for prompt in prompts:
            ids = tokenizer.encode(self.render(prompt, tokenizer))
            bos = tokenizer.bos_id
            prefix = [] if bos is None or ids[:1] == [bos] else [bos]
            rows.append(prefix + self._cut(ids, self.max_length - len(prefix), prompt))
        return rows

    def _cut(self, ids: list[int], budget: int, prompt: RawPrompt) -> list[int]:
        if len(ids) <= budget:
            return ids
        if self.truncation == "left":
            return ids[-budget:]
        if self.truncation == "right":
            return ids[:budget]
        shown = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        raise UserError(
            f"a prompt is {len(ids)} tokens long, over task.max_prompt_length = {self.max_length} "
            f'(task.truncation = "error"): {shown[:80]!r}... Raise task.max_prompt_length, or set '
            'task.truncation = "left" (keep the end, where the question is) or "right".'
        )

    def longest(self, prompts: Sequence[RawPrompt], tokenizer: Tokenizer) -> int:
        """Tokens of the longest prompt before any cut (the input check's figure)."""
        return max(len(tokenizer.encode(self.render(p, tokenizer))) for p in prompts)
