"""PNG charts of a math GRPO run (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_training(
    history: list[dict[str, Any]], evals: list[tuple[int, float]], path: Path, title: str
) -> None:
    """Reward and sampled accuracy per step, held-out accuracy at each evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(steps, [r["reward"] for r in history], label="mean reward")
    left.plot(steps, [r["sample_accuracy"] for r in history], label="sampled accuracy")
    left.set_xlabel("GRPO step")
    left.legend()
    left.grid(alpha=0.3)
    right.plot([s for s, _ in evals], [100 * a for _, a in evals], marker="o", color="tab:green")
    right.set_xlabel("GRPO step")
    right.set_ylabel("held-out accuracy (%), greedy")
    right.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
