"""Rule-based verifier: extract the final number of a completion and compare exactly.

>>> extract_answer("The answer is 1,234.")
'1234'
>>> extract_answer("so x = 3 ... #### -0012")
'-12'
>>> score_completion("52", "52", ended=True, format_reward=0.1)
Score(reward=1.1, correct=True, well_formed=True, extracted='52')
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")
_MARKED = (
    re.compile(r"####\s*([-+]?[\d,]+(?:\.\d+)?)"),
    re.compile(r"\\boxed\{\s*([-+]?[\d,]+(?:\.\d+)?)\s*\}"),
)
_BARE = re.compile(r"^\s*-?\d+\s*$")


def normalize_number(text: str) -> str | None:
    """``'1,234'``, ``'+07'``, ``'12.0'``, ``'-0'`` -> ``'1234'``, ``'7'``, ``'12'``, ``'0'``;
    None if ``text`` is not a number (or has a fractional part: answers here are integers)."""
    text = text.strip().rstrip(".").replace(",", "")
    if not re.fullmatch(r"[-+]?\d+(?:\.\d+)?", text):
        return None
    sign = "-" if text.startswith("-") else ""
    digits = text.lstrip("+-")
    if "." in digits:
        whole, fraction = digits.split(".")
        if fraction.strip("0"):
            return None
        digits = whole
    digits = digits.lstrip("0") or "0"
    return "0" if digits == "0" else sign + digits


def extract_answer(completion: str) -> str | None:
    """The answer a completion gives: after ``####`` or in ``\\boxed{}`` if present, else the
    last number in the text; normalized. None when there is no number."""
    for pattern in _MARKED:
        found = pattern.findall(completion)
        if found:
            return normalize_number(found[-1])
    numbers = _NUMBER.findall(completion)
    return normalize_number(numbers[-1]) if numbers else None


@dataclass(frozen=True)
class Score:
    reward: float
    correct: bool
    well_formed: bool
    extracted: str | None


def score_completion(completion: str, answer: str, ended: bool, format_reward: float) -> Score:
    """Reward 1 for the exact answer plus ``format_reward`` for a bare number ended by the model
    (end-of-text emitted, nothing but the number)."""
    extracted = extract_answer(completion)
    correct = extracted is not None and extracted == answer
    well_formed = ended and bool(_BARE.match(completion))
    return Score(float(correct) + (format_reward if well_formed else 0.0), correct, well_formed, extracted)
