"""The PPO critic's model: the policy's transformer with a scalar value head.

``V_t`` is read at the position that predicts completion token ``t`` (the state before the
token is emitted), the same positions the policy's log-probs come from, so GAE's
``delta_t = r_t + gamma V_{t+1} - V_t`` lines up with the policy's tokens. The head starts at
zero: the first values are 0 and the first advantages are the returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlinf_hpc.engines.generation import join_rows


class ValueModel(torch.nn.Module):
    """``policy`` (a causal LM; its ``base_model`` gives hidden states) + a linear head."""

    def __init__(self, policy: Any) -> None:
        super().__init__()
        self.policy = policy
        hidden = policy.config.hidden_size
        self.head = torch.nn.Linear(hidden, 1, dtype=next(policy.parameters()).dtype)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.policy.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden).squeeze(-1).float()


def sequence_values(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    pad_id: int,
    device: str = "cpu",
) -> list[torch.Tensor]:
    """The value of every completion token's state (with grad if enabled)."""
    ids, mask, spans = join_rows(prompt_ids, completion_ids, pad_id)
    values = model(ids.to(device), mask.to(device))[:, :-1]
    return [values[i, span] for i, span in enumerate(spans)]
