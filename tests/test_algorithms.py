"""rlinf_hpc.algorithms against values computed by hand from the formulas (float64).

Means carry veRL's ``+ 1e-8`` in their denominators, so hand values that divide exactly are
compared to a relative 1e-7; everything else to 1e-12."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from rlinf_hpc.algorithms import (
    LOSS_AGG_MODES,
    DataParallelScale,
    RunningMeanStd,
    agg_loss,
    clipped_value_loss,
    entropy_from_logits,
    gae_advantage_return,
    grpo_outcome_advantage,
    kl_penalty,
    masked_whiten,
    outcome_token_rewards,
    pad_right,
    ppo_policy_loss,
)

D = torch.float64


def test_grpo_advantage_by_hand_with_uneven_groups_and_lengths() -> None:
    scores = [1.0, 0.0, 0.1, 1.1, 0.3, 0.3, 0.7]
    index = ["a", "a", "a", "b", "b", "b", "c"]  # c: a group of one
    lengths = [3, 1, 2, 3, 2, 1, 2]
    mask = pad_right([torch.ones(n, dtype=D) for n in lengths], 4)[1]
    adv, returns = grpo_outcome_advantage(
        outcome_token_rewards(torch.tensor(scores, dtype=D), mask), mask, index
    )
    by_group: dict[str, list[float]] = {}
    for s, g in zip(scores, index, strict=True):
        by_group.setdefault(g, []).append(s)
    for i, (s, g) in enumerate(zip(scores, index, strict=True)):
        group = by_group[g]
        if len(group) == 1:
            expected = s / float(torch.tensor(1.0) + 1e-6)  # mean 0, std 1: veRL's float32 one
        else:
            expected = (s - statistics.fmean(group)) / (statistics.stdev(group) + 1e-6)
        assert adv[i, : lengths[i]].tolist() == pytest.approx([expected] * lengths[i], abs=1e-12)
        assert adv[i, lengths[i] :].abs().sum() == 0  # padding stays 0
    assert torch.equal(adv, returns)
    centred, _ = grpo_outcome_advantage(
        outcome_token_rewards(torch.tensor(scores, dtype=D), mask), mask, index, norm_adv_by_std=False
    )
    assert centred[0, 0].item() == pytest.approx(1.0 - statistics.fmean([1.0, 0.0, 0.1]), abs=1e-12)


def test_uniform_group_in_float32_gives_exactly_zero() -> None:
    rewards = torch.full((16, 1), 0.1, dtype=torch.float32)
    adv, _ = grpo_outcome_advantage(rewards, torch.ones(16, 1), [0] * 16)
    assert adv.abs().max().item() == 0.0


def test_gae_by_hand_and_masked_whitening() -> None:
    gamma, lam = 0.9, 0.8
    values = torch.tensor([[0.5, 0.2, -0.1, 9.0], [0.3, 0.4, 9.0, 9.0]], dtype=D)  # 9: padding
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=D)
    rewards = torch.tensor([[0.0, 0.1, 1.0, 0.0], [0.0, -0.5, 0.0, 0.0]], dtype=D)
    adv, ret = gae_advantage_return(rewards, values, mask, gamma, lam, whiten=False)
    for row, n in ((0, 3), (1, 2)):
        v, r = values[row, :n].tolist(), rewards[row, :n].tolist()
        expected, running = [0.0] * n, 0.0
        for t in reversed(range(n)):
            nxt = v[t + 1] if t + 1 < n else 0.0
            running = r[t] + gamma * nxt - v[t] + gamma * lam * running
            expected[t] = running
        assert adv[row, :n].tolist() == pytest.approx(expected, abs=1e-12)
        assert ret[row, :n].tolist() == pytest.approx(
            [a + b for a, b in zip(expected, v, strict=True)], abs=1e-12
        )
    whitened, _ = gae_advantage_return(rewards, values, mask, gamma, lam)
    valid = adv[mask.bool()].tolist()
    mean, std = statistics.fmean(valid), statistics.stdev(valid)  # unbiased, as masked_whiten
    expected = [(a - mean) / math.sqrt(std**2 + 1e-8) for a in valid]
    assert whitened[mask.bool()].tolist() == pytest.approx(expected, rel=1e-7)
    assert masked_whiten(adv, mask, shift_mean=False)[mask.bool()].tolist() == pytest.approx(
        [e + mean for e in expected], rel=1e-7
    )


def _hand_token_loss(
    logp: float, old: float, a: float, low: float, high: float, c: float
) -> tuple[float, bool, bool]:
    ratio = math.exp(max(-20.0, min(20.0, logp - old)))
    l1, l2 = -a * ratio, -a * min(max(ratio, 1 - low), 1 + high)
    loss = max(l1, l2)
    lower = a < 0 and loss > -a * c
    if a < 0:
        loss = min(loss, -a * c)
    return loss, l2 > l1, lower


def test_policy_loss_clip_higher_dual_clip_metrics_and_every_aggregation() -> None:
    low, high, c = 0.2, 0.28, 3.0
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], dtype=D)
    logp = torch.tensor([[-0.5, -1.1, -1.0], [0.0, -2.1, 0.0], [-0.6, 0.0, 0.0]], dtype=D)
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0], [0.5, 0.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=D)
    hand = [
        [
            _hand_token_loss(logp[i, t].item(), old[i, t].item(), advantages[i, t].item(), low, high, c)
            for t in range(3)
        ]
        for i in range(3)
    ]
    valid = [(i, t) for i in range(3) for t in range(3) if mask[i, t]]
    token_losses = {(i, t): hand[i][t][0] for i, t in valid}
    per_seq = [[token_losses[(i, t)] for t in range(3) if mask[i, t]] for i in range(3)]
    expected = {
        "token-mean": sum(token_losses.values()) / len(valid),
        "seq-mean-token-sum": statistics.fmean(sum(s) for s in per_seq),
        "seq-mean-token-mean": statistics.fmean(statistics.fmean(s) for s in per_seq),
        "seq-mean-token-sum-norm": statistics.fmean(sum(s) for s in per_seq) / 3,  # T = 3
    }
    for mode in LOSS_AGG_MODES:
        loss, metrics = ppo_policy_loss(old, logp, advantages, mask, low, high, c, mode)
        assert loss.item() == pytest.approx(expected[mode], rel=1e-7), mode
    # row 1 token 0: A < 0 with ratio e^2 = 7.4 > c: the dual clip bounds it at -A * c = 6
    assert hand[1][0][0] == pytest.approx(6.0) and hand[1][0][2]
    assert metrics.pg_clipfrac.item() == pytest.approx(sum(hand[i][t][1] for i, t in valid) / len(valid))
    assert metrics.pg_clipfrac_lower.item() == pytest.approx(
        sum(hand[i][t][2] for i, t in valid) / len(valid)
    )
    kl = sum(old[i, t].item() - logp[i, t].item() for i, t in valid) / len(valid)
    assert metrics.ppo_kl.item() == pytest.approx(kl, rel=1e-7)
    # row 0 token 0 (A > 0, ratio e^0.5 = 1.65 > 1.28) is clipped by clip-higher's bound
    assert hand[0][0][0] == pytest.approx(-1.28) and hand[0][0][1]
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        ppo_policy_loss(old, logp, advantages, mask, low, high, 1.0)


def test_decoupled_policy_loss_clips_around_the_proximal_policy_and_weights_by_the_behaviour() -> None:
    """The decoupled objective: with the proximal policy equal to the behaviour policy it is the
    plain one; otherwise each token's clipped loss is taken against the proximal policy and
    scaled by pi_prox / pi_behav, and a token whose weight passes the cap is left out."""
    low, high, c = 0.2, 0.28, 3.0
    behaviour = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, 0.0]], dtype=D)
    logp = torch.tensor([[-0.5, -1.1, -1.0], [0.0, -2.1, 0.0]], dtype=D)
    advantages = torch.tensor([[1.0, 1.0, -1.0], [-2.0, -2.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=D)
    plain, plain_metrics = ppo_policy_loss(behaviour, logp, advantages, mask, low, high, c)
    same, same_metrics = ppo_policy_loss(
        behaviour, logp, advantages, mask, low, high, c, proximal_log_prob=behaviour.clone()
    )
    assert same.item() == pytest.approx(plain.item(), rel=1e-12)
    assert same_metrics.behaviour_weight.item() == pytest.approx(1.0)
    assert same_metrics.behaviour_capped.item() == 0.0 and plain_metrics.behaviour_weight is None
    # the proximal policy one update ahead of the behaviour; token (0, 2) ran 2 nats away: capped
    proximal = torch.tensor([[-0.6, -0.9, 1.0], [-1.5, -2.2, 0.0]], dtype=D)
    loss, metrics = ppo_policy_loss(
        behaviour, logp, advantages, mask, low, high, c, proximal_log_prob=proximal, behaviour_weight_cap=5.0
    )
    valid = [(i, t) for i in range(2) for t in range(3) if mask[i, t]]
    weights = {(i, t): math.exp(proximal[i, t].item() - behaviour[i, t].item()) for i, t in valid}
    assert weights[(0, 2)] > 5.0 and all(w < 5.0 for k, w in weights.items() if k != (0, 2))
    expected = sum(
        weights[(i, t)]
        * _hand_token_loss(logp[i, t].item(), proximal[i, t].item(), advantages[i, t].item(), low, high, c)[0]
        for i, t in valid
        if (i, t) != (0, 2)
    ) / len(valid)  # token-mean: the dropped token still counts in the denominator
    assert loss.item() == pytest.approx(expected, rel=1e-9)
    assert metrics.behaviour_capped.item() == pytest.approx(1 / len(valid))
    kept = [w for k, w in weights.items() if k != (0, 2)]
    assert metrics.behaviour_weight.item() == pytest.approx(sum(kept) / len(kept))
    # ppo_kl is the sampled KL from the proximal policy (where the clip is centred)
    kl = sum(proximal[i, t].item() - logp[i, t].item() for i, t in valid) / len(valid)
    assert metrics.ppo_kl.item() == pytest.approx(kl, rel=1e-7)
    with pytest.raises(ValueError, match="behaviour weight cap must be > 1"):
        ppo_policy_loss(behaviour, logp, advantages, mask, low, high, c, behaviour_weight_cap=1.0)


def test_kl_estimators_and_their_clamps() -> None:
    logp = torch.tensor([-1.0, -30.0, -0.1], dtype=D)
    ref = torch.tensor([-1.5, -0.1, -30.0], dtype=D)
    d = [a - b for a, b in zip(logp.tolist(), ref.tolist(), strict=True)]
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx(d)
    assert kl_penalty(logp, ref, "kl").tolist() == pytest.approx(d)
    assert kl_penalty(logp, ref, "abs").tolist() == pytest.approx([abs(x) for x in d])
    assert kl_penalty(logp, ref, "k2").tolist() == pytest.approx([x * x / 2 for x in d])
    k3 = kl_penalty(logp, ref, "k3").tolist()
    assert k3[0] == pytest.approx(math.exp(-0.5) + 0.5 - 1)
    assert k3[1] == 10.0  # exp(20) - 20 - 1 (log-ratio clamped at 20), then capped at 10
    assert k3[2] == 10.0  # log-ratio -29.9 -> -20: e^-20 + 20 - 1 = 19, capped at 10
    assert kl_penalty(logp, ref, "low_var_kl").tolist() == k3
    with pytest.raises(ValueError, match="not one of k1, abs, k2, k3"):
        kl_penalty(logp, ref, "k4")


def test_data_parallel_shares_add_up_to_the_global_aggregate() -> None:
    generator = torch.Generator().manual_seed(0)
    losses = torch.randn(6, 5, generator=generator, dtype=D)
    lengths = [5, 1, 3, 2, 4, 1]
    mask = pad_right([torch.ones(n, dtype=D) for n in lengths], 5)[1]
    halves = [slice(0, 2), slice(2, 6)]  # unequal shares: 6 vs 10 tokens
    dp = DataParallelScale(tokens=float(sum(lengths)), sequences=6.0, ranks=2)
    for mode in LOSS_AGG_MODES:
        whole = agg_loss(losses, mask, mode).item()
        shares = [agg_loss(losses[h], mask[h], mode, dp).item() for h in halves]
        assert sum(shares) / 2 == pytest.approx(whole, rel=1e-7), mode  # DDP averages ranks
    plain = [agg_loss(losses[h], mask[h], "token-mean").item() for h in halves]
    assert sum(plain) / 2 != pytest.approx(agg_loss(losses, mask, "token-mean").item())


def test_value_loss_and_entropy_by_hand() -> None:
    vpreds = torch.tensor([[2.0, 0.2, 5.0]], dtype=D)
    values = torch.tensor([[0.0, 0.0, 0.0]], dtype=D)
    returns = torch.tensor([[1.0, 1.0, 1.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=D)
    loss, clipfrac = clipped_value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    # token 0: max((2-1)^2, (0.5-1)^2) = 1; token 1: max(0.64, 0.64) = 0.64 (clip inactive)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 0.64) / 2)
    assert clipfrac.item() == 0.0
    one = torch.ones(1, 1, dtype=D)
    loss, clipfrac = clipped_value_loss(1.2 * one, one, 0 * one, one, 0.5)  # clipped to 0.5: worse
    assert loss.item() == pytest.approx(0.5 * 0.25) and clipfrac.item() == pytest.approx(1.0)
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9]], dtype=D)
    assert entropy_from_logits(logits).tolist() == pytest.approx(
        [math.log(4), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    )


def test_global_normalization_under_ddp_on_two_ranks() -> None:
    from conftest import run_mpi_program

    result = run_mpi_program(2, "algorithm_checks.py", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "DP NORMALIZATION OK for token-mean" in result.stdout
    assert "RUNNING STATISTICS OK" in result.stdout


def test_running_statistics_merge_batches_exactly_and_clip() -> None:
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, 3, generator=generator, dtype=D) * 5 + 2 for n in (1, 7, 100, 3)]
    rms = RunningMeanStd(3)
    for rows in batches:
        rms.update(rows)
    rms.update(torch.zeros(0, 3))  # an empty batch changes nothing
    every = torch.cat(batches)
    assert torch.allclose(rms.mean, every.mean(0)) and torch.allclose(rms.var, every.var(0, unbiased=False))
    assert int(rms.count) == 111
    normalized = rms.normalize(every.float(), clip=10.0)
    assert normalized.dtype == torch.float32
    assert torch.allclose(normalized.mean(0), torch.zeros(3), atol=1e-5)
    assert torch.allclose(normalized.std(0, unbiased=False), torch.ones(3), atol=1e-4)
    assert rms.normalize(torch.full((1, 3), 1e6), clip=5.0).tolist() == [[5.0, 5.0, 5.0]]
    scale = RunningMeanStd(1)
    scale.update(torch.tensor([2.0, -2.0]))  # mean 0, variance 4: rewards halved, clipped at 3
    assert scale.scale(torch.tensor([1.0, 100.0]), clip=3.0).tolist() == pytest.approx([0.5, 3.0])
    assert "mean" in rms.state_dict() and "count" in rms.state_dict()  # checkpointed, synced
