"""The embodied app: simulators on env ranks, the policy on policy ranks, PPO on actor ranks."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rlinf_hpc.apps.embodied.envs import GymBatch, Spec, check_env_id
from rlinf_hpc.apps.embodied.model import ActorCritic
from rlinf_hpc.config import load_config
from rlinf_hpc.errors import UserError
from rlinf_hpc.runtime.checkpoint.store import config_differences

from conftest import CONFIGS, rlinf

CARTPOLE = CONFIGS / "embodied_ppo_cartpole.toml"
SMALL = ["env.envs_per_rank=8", "ppo.rollout_steps=64"]


def _random_actions(spec: Spec, rng: np.random.Generator, n: int) -> np.ndarray:
    if spec.discrete:
        return rng.integers(0, spec.action_dim, n)
    return rng.uniform(-1, 1, (n, spec.action_dim)).astype(np.float32)


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Hopper-v5"])
def test_env_state_round_trip_continues_exactly(env_id: str) -> None:
    if env_id.startswith("Hopper"):
        pytest.importorskip("mujoco")
    batch = GymBatch(env_id, 3, seed=5, rank=1)
    batch.reset()
    rng = np.random.default_rng(0)
    for _ in range(40):  # past some episode ends (CartPole resets itself, Hopper may fall)
        batch.step(_random_actions(batch.spec, rng, 3))
    state = batch.get_state()
    actions = [_random_actions(batch.spec, rng, 3) for _ in range(60)]
    first = [batch.step(a) for a in actions]
    batch.set_state(state)
    again = [batch.step(a) for a in actions]
    for a, b in zip(first, again, strict=True):
        assert np.array_equal(a.obs, b.obs) and np.array_equal(a.reward, b.reward)
        assert np.array_equal(a.terminated, b.terminated) and a.episode_returns == b.episode_returns
    other = GymBatch(env_id, 3, seed=5, rank=2)  # another rank: other seeds
    assert not np.array_equal(other.reset(), GymBatch(env_id, 3, seed=5, rank=1).reset())


def test_truncation_reports_the_final_observation_not_the_reset_one() -> None:
    batch = GymBatch("CartPole-v1", 1, seed=0, rank=0, max_episode_steps=5)
    batch.reset()
    results = [batch.step(np.array([i % 2])) for i in range(5)]
    last = results[-1]
    assert last.truncated[0] and not last.terminated[0] and last.episode_lengths == [5]
    assert not np.array_equal(last.final_obs, last.obs)  # obs is the next episode's first


def test_bad_environments_are_user_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UserError, match="Nearest registered: CartPole-v1"):
        check_env_id("CartPol-v1")
    with pytest.raises(UserError, match="takes flat vector observations"):
        check_env_id("Blackjack-v1")  # a Tuple observation space
    with pytest.raises(UserError, match="not accepted by gymnasium.make"):
        check_env_id("CartPole-v1", {"no_such_option": 1})
    if importlib.util.find_spec("Box2D") is None:  # not a MuJoCo task: no MuJoCo advice (it had it)
        with pytest.raises(UserError, match="not installed") as box2d:
            check_env_id("CarRacing-v3")
        assert "mujoco" not in str(box2d.value).lower() and "install what it names" in str(box2d.value)
    import gymnasium

    def missing(*args: object, **kwargs: object) -> None:
        raise ModuleNotFoundError("No module named 'mujoco'")  # what make() raises without it

    monkeypatch.setattr(gymnasium, "make", missing)
    with pytest.raises(UserError, match=r"Hopper-v5' needs a package that is not installed.*\[mujoco\]"):
        check_env_id("Hopper-v5")


def test_sampling_takes_its_randomness_from_the_caller() -> None:
    torch.manual_seed(0)
    model = ActorCritic(Spec(4, True, 3), [16])
    obs, noise = torch.randn(8, 4), torch.rand(8)
    a1, lp1 = model.act(obs, noise)
    a2, lp2 = model.act(obs, noise)
    assert torch.equal(a1, a2) and torch.equal(lp1, lp2)  # same noise, same actions: any rank
    assert torch.allclose(model.log_prob_entropy(obs, a1)[0], lp1)
    gaussian = ActorCritic(Spec(3, False, 2, (-1.0, -1.0), (1.0, 1.0)), [16])
    actions, logp = gaussian.act(obs[:, :3], torch.randn(8, 2))
    assert torch.allclose(gaussian.log_prob_entropy(obs[:, :3], actions)[0], logp)


def test_config_mistakes_name_the_keys(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="cannot be split into env.pipeline_stages = 3"):
        load_config(CARTPOLE, ["env.pipeline_stages=3"])
    with pytest.raises(UserError, match="unknown key `ppo.epoch`.*Did you mean `epochs`"):
        load_config(CARTPOLE, ["ppo.epoch=3"])


def test_observation_normalization_is_in_the_model_and_fixed_for_a_resume() -> None:
    spec = check_env_id("CartPole-v1")
    model = ActorCritic(spec, [8], obs_clip=5.0)
    obs = torch.tensor([[1.0, 2.0, 3.0, 4.0], [3.0, 2.0, 1.0, 0.0]])
    before = model.value(obs)
    model.obs_rms.update(obs)  # the networks now see standardized inputs
    assert torch.allclose(model.inputs(obs)[:, 0], torch.tensor([-1.0, 1.0]), atol=1e-4)
    assert not torch.allclose(model.value(obs), before)
    assert {"obs_rms.mean", "obs_rms.var", "obs_rms.count"} <= set(model.state_dict())
    saved = load_config(CARTPOLE).model_dump(mode="json")
    on = load_config(CARTPOLE, ["ppo.normalize_observations=true", "ppo.normalize_rewards=true"])
    changed, fixed = config_differences(saved, on.model_dump(mode="json"))
    assert fixed == ["ppo.normalize_observations"]  # the model's state would not fit
    assert "ppo.normalize_rewards" in changed  # resumable with --force-resume


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.mpi
def test_cartpole_return_rises(tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = rlinf("run", str(CARTPOLE), "--run-dir", str(run), *[f"--set={s}" for s in SMALL],
                   "--set=ppo.iterations=40", timeout=240)  # fmt: skip
    assert result.returncode == 0, result.output
    summary = _summary(run)
    # an untrained policy balances ~20 steps; PPO gets far past it in 40 updates (~20k steps)
    assert summary["return_start"] < 40, summary
    assert summary["return_end"] > 3 * summary["return_start"] and summary["return_end"] > 100, summary
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(1, 41))
    assert all(r["staleness"] == 0 for r in records)
    assert (run / "progress.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.mpi
def test_placements_and_rank_splits_that_cannot_work_are_refused(tmp_path: Path) -> None:
    result = rlinf("run", str(CARTPOLE), "--set=placement.mode=collocated", "--set=job.num_ranks=3")
    assert result.returncode == 2, result.output
    assert "puts env and policy on the same ranks" in result.stderr
    split = ["--set=components.actor.num_ranks=2", "--set=components.env.num_ranks=3"]
    split.append("--set=job.num_ranks=7")
    result = rlinf("run", str(CARTPOLE), *split)
    assert result.returncode == 2, result.output
    assert "components.env.num_ranks = 3 cannot be split evenly" in result.stderr
    result = rlinf("run", str(CARTPOLE), "--set=placement.mode=auto")  # auto needs the group it splits
    assert result.returncode == 2 and 'Add groups = [["policy", "actor"]]' in result.stderr, result.output
    shared = ["--set=placement.mode=auto", '--set=placement.groups=[["policy", "actor"]]']
    wider = ["--set=components.policy.num_ranks=2", "--set=job.num_ranks=6"]
    result = rlinf("run", str(CARTPOLE), *shared, *wider)
    assert result.returncode == 2, result.output  # the warm-up's actor on 3 ranks for 2 env ranks
    assert "the 3 ranks policy and actor share in auto's warm-up" in result.stderr


#: Record fields that measure time (or name the placement), not learning.
TIMING = {"rollout_s", "env_wait_s", "env_step_s", "policy_busy_s", "policy_batch", "receive_s", "train_s",
          "weight_sync_s", "iteration_s", "elapsed_s", "placement", "rollout_cpu_s", "train_cpu_s",
          "cpu_s"}  # fmt: skip


@pytest.mark.mpi
def test_a_stopped_run_resumes_exactly_in_another_placement(tmp_path: Path) -> None:
    """Asynchronous updates, observation and reward normalization. An uninterrupted run with
    policy and actor time-sharing two ranks (two policy ranks serving as the load balance has
    it), against a disaggregated run with one policy rank that SIGUSR2 stops after iteration 2
    of 5 and a rerun resumes (env states and discounted returns, noise, actor with its running
    statistics, and the rollout collected but not yet trained on): the same numbers, since the
    env ranks draw the sampling noise and every request gets its own forward pass."""
    sets = ["env.envs_per_rank=4", "ppo.rollout_steps=32", "ppo.minibatches=2", "ppo.iterations=5",
            "ppo.async_updates=true", "flow.runner=job_workers:EMBODIED_INTERRUPT",
            "ppo.normalize_observations=true", "ppo.normalize_rewards=true"]  # fmt: skip
    args = [f"--set={s}" for s in sets]
    shared = ["--set=placement.mode=hybrid", '--set=placement.groups=[["policy", "actor"]]',
              "--set=components.policy.num_ranks=2", "--set=job.num_ranks=5"]  # fmt: skip
    whole = rlinf("run", str(CARTPOLE), "--run-dir", str(tmp_path / "whole"), *args, *shared,
                  "--set=flow.options={after_step=99}")  # fmt: skip
    assert whole.returncode == 0, whole.output
    assert "take turns there instead of overlapping" in whole.stderr  # said, not refused
    stop = ["--set=flow.options={after_step=2}"]
    first = rlinf("run", str(CARTPOLE), "--run-dir", str(tmp_path / "cut"), *args, *stop)
    assert first.returncode != 0 and "step 2" in first.output, first.output
    again = rlinf("run", str(CARTPOLE), "--run-dir", str(tmp_path / "cut"), *args, *stop)
    assert again.returncode == 0, again.output
    assert _summary(tmp_path / "cut")["resumed_from_iteration"] == 2

    def learning(run: Path) -> list[dict]:
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k not in TIMING} for r in records]

    records = learning(tmp_path / "whole")
    assert [r["staleness"] for r in records] == [0, 1, 1, 1, 1]  # the first rollout is fresh
    # stale rollouts train with the decoupled loss: weighted by proximal / behaviour probability
    assert ["behaviour_weight" in r for r in records] == [False, True, True, True, True]
    assert all(r["behaviour_weight"] != 1.0 and r["behaviour_capped"] < 0.05 for r in records[1:])
    scales = [r["reward_scale"] for r in records]  # CartPole: +1 a step, returns grow to ~1/(1-gamma)
    assert scales[0] > 1 and len(set(scales)) == len(scales), scales
    assert learning(tmp_path / "cut") == records


@pytest.mark.mpi
@pytest.mark.parametrize("force", ["shared", "split"])
def test_auto_measures_policy_and_actor_shared_and_split_and_keeps_the_faster(
    tmp_path: Path, force: str
) -> None:
    """placement.mode = "auto" with groups = [["policy", "actor"]]: two iterations with both on
    the group's two ranks, two with the policy on one and the actor on the other, then the
    faster (forced here) — moving back to shared when it wins, where the joining actor rank
    adopts the trained state and the joining policy rank gets the weights: learning goes on
    (a fresh actor or policy would fall back to the untrained return, ~20). The trials run
    synchronously; asynchronous updates start after the decision."""
    run = tmp_path / "run"
    sets = [*SMALL, "ppo.iterations=10", "ppo.async_updates=true", "placement.mode=auto",
            'placement.groups=[["policy", "actor"]]', "flow.runner=job_workers:EMBODIED_AUTO",
            f'flow.options={{force="{force}"}}']  # fmt: skip
    result = rlinf("run", str(CARTPOLE), "--run-dir", str(run), *[f"--set={s}" for s in sets], timeout=240)
    assert result.returncode == 0, result.output
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    placements = [r["placement"] for r in records]
    assert placements[:4] == ["auto:trial (shared)"] * 2 + ["auto:trial (split)"] * 2
    assert set(placements[4:]) == {f"auto:{force}"}
    assert [r["staleness"] for r in records] == [0] * 5 + [1] * 5  # async from the decision on
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    decided = next(e for e in events if e.get("event") == "auto_placement")
    expected = {"shared": ([1, 2], [1, 2]), "split": ([1], [2])}[force]
    assert (decided["choice"], decided["policy"], decided["actor"]) == (force, *expected)
    assert any(e.get("event") == "auto_placement_measured" for e in events)
    returns = [r["return_recent"] for r in records]
    assert returns[-1] > 1.5 * returns[1], returns  # learning went on after every move
    assert _summary(run)["placement"] == f"auto:{force}"
