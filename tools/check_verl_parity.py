#!/usr/bin/env python
"""Cross-check rlinf_hpc.algorithms against veRL's own ``core_algos`` in float64.

    pip download verl==0.9.1 --no-deps -d /tmp/verl && unzip -q /tmp/verl/verl-*.whl -d /tmp/verl/src
    pip install omegaconf
    python tools/check_verl_parity.py --verl /tmp/verl/src [--trials 200] [--tol 1e-9]

Random batches (1-40 responses, 1-12 tokens, fully masked rows, groups of one, uniform groups,
ratios near 1 and far from it, extreme KL) through both implementations: GRPO outcome
advantages (with and without std normalization), GAE and returns, the vanilla PPO policy loss
with clip-higher and dual clip in every ``loss_agg_mode`` and its three metrics, ``agg_loss``,
the clipped value loss, every KL estimator, ``masked_whiten``. Prints the largest absolute
difference per function; exit 1 if any exceeds ``--tol``.

veRL imports ray, tensordict and others at module level although these functions use none of
them; those of them (`STAND_INS`) that are not installed are replaced by empty stand-ins for
the import only (a stand-in that were called would fail the comparison, not hide it).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any
from unittest import mock

#: veRL's module-level imports the compared functions do not use.
STAND_INS = frozenset(
    {"ray", "tensordict", "codetiming", "hydra", "datasets", "pylatexenc", "wandb", "peft", "torchdata",
     "pyarrow", "dill", "pandas", "orjson"}
)  # fmt: skip


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: empty modules for the `STAND_INS` that are not installed."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] not in STAND_INS:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = mock.MagicMock(name=spec.name)
        module.__path__, module.__spec__ = [], spec
        return module

    def exec_module(self, module: ModuleType) -> None:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--verl", help="a directory holding the verl package (default: the installed one)")
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--tol", type=float, default=1e-9)
    args = parser.parse_args()
    if args.verl:
        sys.path.insert(0, args.verl)
    if importlib.util.find_spec("verl") is None:
        raise SystemExit("veRL is not importable: pass --verl DIR (see the docstring)")
    sys.meta_path.append(_StandIns())
    import numpy as np
    import torch
    from omegaconf import OmegaConf
    from verl.trainer.ppo import core_algos
    from verl.utils import torch_functional as verl_f

    import rlinf_hpc.algorithms as ours

    d = torch.float64
    worst: dict[str, float] = {}

    def compare(name: str, theirs: Any, mine: Any) -> None:
        gap = (torch.as_tensor(theirs, dtype=d) - torch.as_tensor(mine, dtype=d)).abs().max().item()
        worst[name] = max(worst.get(name, 0.0), gap)

    torch.manual_seed(0)
    for trial in range(args.trials):
        batch, width = int(torch.randint(2, 40, ())), int(torch.randint(1, 12, ()))
        lengths = torch.randint(1, width + 1, (batch,))
        if trial % 7 == 0:
            lengths[0] = 0  # a fully masked row
        mask = (torch.arange(width)[None] < lengths[:, None]).to(d)
        index = np.array(
            [f"u{int(i)}" for i in torch.randint(0, int(torch.randint(1, batch + 1, ())), (batch,))]
        )
        scores = torch.randint(0, 3, (batch,)).to(d) * 0.55 if trial % 3 else torch.randn(batch, dtype=d)
        rewards = torch.zeros(batch, width, dtype=d)
        rewards[torch.arange(batch), (lengths - 1).clamp(min=0)] = scores * (lengths > 0)
        for norm in (True, False):
            theirs, _ = core_algos.compute_grpo_outcome_advantage(rewards.clone(), mask, index, 1e-6, norm)
            mine, _ = ours.grpo_outcome_advantage(rewards.clone(), mask, list(index), 1e-6, norm)
            compare(f"grpo advantage (norm_adv_by_std={norm})", theirs, mine)
        values, token_rewards = torch.randn(batch, width, dtype=d), torch.randn(batch, width, dtype=d) * mask
        gamma, lam = float(torch.rand(())), float(torch.rand(()))
        logp = torch.randn(batch, width, dtype=d) * 0.5 - 1
        old = logp + torch.randn(batch, width, dtype=d) * (0.05 if trial % 2 else 3.0)
        adv = torch.randn(batch, width, dtype=d)
        if mask.sum() >= 2:
            theirs = core_algos.compute_gae_advantage_return(token_rewards, values, mask, gamma, lam)
            mine = ours.gae_advantage_return(token_rewards, values, mask, gamma, lam)
            compare("gae advantages", theirs[0], mine[0])
            compare("gae returns", theirs[1], mine[1])
            compare("masked_whiten", verl_f.masked_whiten(adv, mask), ours.masked_whiten(adv, mask))
        low, high = float(torch.rand(()) * 0.3 + 0.05), float(torch.rand(()) * 0.3 + 0.3)
        c = float(1.5 + torch.rand(()) * 3)
        actor = OmegaConf.create(
            {"clip_ratio": 0.2, "clip_ratio_low": low, "clip_ratio_high": high, "clip_ratio_c": c,
             "global_batch_info": {}}
        )  # fmt: skip
        for mode in ours.LOSS_AGG_MODES:
            loss, metrics = core_algos.compute_policy_loss_vanilla(old, logp, adv, mask, mode, actor)
            my_loss, my_metrics = ours.ppo_policy_loss(old, logp, adv, mask, low, high, c, mode)
            compare(f"policy loss ({mode})", loss, my_loss)
            for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
                compare(key, metrics[f"actor/{key}"], getattr(my_metrics, key))
            compare(
                f"agg_loss ({mode})", core_algos.agg_loss(adv, mask, mode), ours.agg_loss(adv, mask, mode)
            )
            theirs = core_algos.compute_value_loss(values + adv, token_rewards, values, mask, 0.5, mode)
            mine = ours.clipped_value_loss(values + adv, token_rewards, values, mask, 0.5, mode)
            compare(f"value loss ({mode})", theirs[0], mine[0])
            compare("vf_clipfrac", theirs[1], mine[1])
        ref = logp + torch.randn(batch, width, dtype=d) * 10  # far apart: the k3 clamps engage
        for estimator in ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"):
            compare(
                f"kl ({estimator})",
                core_algos.kl_penalty(logp, ref, estimator),
                ours.kl_penalty(logp, ref, estimator),
            )
    print(f"{'function':<46}max |veRL - ours|  (float64, {args.trials} random batches)")
    for name, gap in worst.items():
        print(f"{name:<46}{gap:.1e}{'' if gap <= args.tol else '  > tol'}")
    bad = [name for name, gap in worst.items() if gap > args.tol]
    print("PARITY OK" if not bad else f"PARITY FAILED: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
