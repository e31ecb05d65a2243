"""The emulated-accelerator workload (`emulated_rl`): its cost model, its config checks, and a
job on 8 ranks whose rollout streams responses downstream while its batch still decodes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rlinf_hpc.apps.emulated.profiles import PROFILES
from rlinf_hpc.config import load_config
from rlinf_hpc.errors import UserError
from rlinf_hpc.scheduler.elastic import micro_batch_bound
from rlinf_hpc.scheduler.engine_model import EngineModel, fit_engine

from conftest import CONFIGS, rlinf

PROFILE = PROFILES["grpo-7b"]


def test_generation_waits_on_its_longest_response_and_batches_pay() -> None:
    """The rollout model: a call lasts at least alpha x its longest response (the long tail),
    responses end in order of length, and bigger calls cost less per response."""
    short, tail = [500] * 16, [500] * 15 + [2000]
    assert PROFILE.rollout_seconds(tail) > 2 * PROFILE.rollout_seconds(short)
    seconds, ends = PROFILE.rollout_schedule([300, 900, 600])
    assert ends[0] < ends[2] < ends[1] == pytest.approx(seconds)
    rng = random.Random(0)
    per_item = {
        k: sum(PROFILE.rollout_seconds(PROFILE.lengths(rng, k)) for _ in range(200)) / (200 * k)
        for k in (8, 32, 128)
    }
    assert per_item[8] > 1.5 * per_item[32] > 1.5 * 1.2 * per_item[128]
    lengths = PROFILE.lengths(random.Random(1), 10_000)
    assert 0.03 < sum(n >= PROFILE.long[0] for n in lengths) / len(lengths) < 0.07  # the 5% tail


def test_a_weight_sync_crosses_the_interconnect_once_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Collocated, the trainer's rank 0 also hosts rollout and inference, and every other rank
    both: each pull slept a whole transfer, one after another on the rank, so a collocated sync
    cost three transfers against one disaggregated (0.99 against 0.33 s a step, a 32B profile
    at 2 GB/s: `auto` was scored against a cost the real sync does not have). The real sync
    leaves a rank's second copy in its mailbox: here a device copy."""
    from rlinf_hpc.apps.emulated import workers

    profile = PROFILES["grpo-32b"]
    slept: list[float] = []
    monkeypatch.setattr(workers, "_HELD", {"sync": -1})

    def stage() -> workers.EmulatedStage:
        worker = workers.EmulatedStage.__new__(workers.EmulatedStage)
        worker.profile = profile
        monkeypatch.setattr(worker, "_sleep", slept.append, raising=False)
        return worker

    actor, rollout, inference = stage(), stage(), stage()  # one rank (one process)
    actor.send_weights(1)
    assert rollout.receive_weights(1) == inference.receive_weights(1) == 0.0
    assert slept[0] == profile.sync_s and slept[1] == slept[2] == profile.weights_gb / workers.LOCAL_COPY_GBPS
    slept.clear()
    assert rollout.receive_weights(2) > 0 and inference.receive_weights(2) == 0.0  # another rank
    assert slept == [profile.sync_s, profile.weights_gb / workers.LOCAL_COPY_GBPS]
    assert sum(slept) < 1.05 * profile.sync_s


class _Feed:
    """What `Feed` gives an engine, without a channel: ``arrivals[i]`` more items become
    available at the engine's i-th take."""

    def __init__(self, items: list[dict], arrivals: list[int]) -> None:
        self.items, self.arrivals, self.ended = list(items), list(arrivals), False
        self.available = 0
        self.slots: int | None = None
        self.reports: list[tuple[int, int, list[int]]] = []

    def progress(self, decode_steps: int, active: int, finished: list[int] = ()) -> None:
        self.reports.append((decode_steps, active, list(finished)))

    def take(self, max_items: int, wait: bool = False) -> list[dict]:
        self.available += self.arrivals.pop(0) if self.arrivals else 0
        count = min(max_items, self.available, len(self.items))
        out, self.items = self.items[:count], self.items[count:]
        self.available -= count
        self.ended = not self.items
        return out


def _engine(
    lengths: list[int], arrivals: list[int], stage: object | None = None, step: int = 0, profile=PROFILE
) -> tuple[object, list[list[dict]]]:
    """One step of an engine (``stage``: the same engine's next step, what it carried kept)."""
    from rlinf_hpc.apps.emulated.workers import EmulatedStage

    if stage is None:
        stage = EmulatedStage.__new__(EmulatedStage)  # no job: the profile and a tiny time scale
        stage.profile, stage.cost, stage.scale, stage._in_work = profile, profile.stages["rollout"], 1e-6, 0
        stage._carry = []
    stage._reset()
    feed = _Feed([{"uid": f"{step}:{i}", "length": n} for i, n in enumerate(lengths)], arrivals)
    stage.feed = feed
    return stage, list(stage.engine(feed))


def test_engine_costs_what_a_generate_call_costs_and_streams_in_order_of_length() -> None:
    """The continuous engine, given the whole batch at once, charges exactly the micro-batch
    model's time (greedy slots = requests joining as slots free) and yields each response
    when done; fed in pieces, requests join the running batch."""
    lengths = PROFILE.lengths(random.Random(3), 3 * PROFILE.slots + 5)
    stage, chunks = _engine(lengths, [len(lengths)])
    assert stage._slept == pytest.approx(PROFILE.rollout_seconds(lengths))
    done = [item["length"] for chunk in chunks for item in chunk]
    assert sorted(done) == sorted(lengths) and done[0] == min(lengths[: PROFILE.slots])
    assert stage._useful == pytest.approx(PROFILE.decode_step_s * sum(lengths) / PROFILE.slots)
    # the same work arriving in two halves: the second half joins the running batch, so the
    # whole costs far less than two separate generate calls of a half each
    half = len(lengths) // 2
    stage, chunks = _engine(lengths, [half] + [0] * 10 + [len(lengths) - half])
    apart = PROFILE.rollout_seconds(lengths[:half]) + PROFILE.rollout_seconds(lengths[half:])
    assert sum(len(c) for c in chunks) == len(lengths)
    assert stage._slept < 0.9 * apart


def test_partial_rollouts_stop_before_the_tail_and_finish_every_response_within_its_span() -> None:
    """With partial rollouts an engine stops once its input ended and 20% of the step's requests
    still decode: it pays far less than the whole call (no long tail), the rest goes on first
    in its next steps (``lag`` = the steps a response began before), and no response spans
    more than ``partial_span`` steps: every one comes out exactly once, none with lag > 2."""
    from dataclasses import replace

    stage, out = None, []
    batches = [PROFILE.lengths(random.Random(10 + k), 48) for k in range(4)]
    for step, lengths in enumerate(batches):
        if stage is not None:
            stage.partial, stage.partial_span = 0.2, 3
        stage, chunks = _engine(lengths, [len(lengths)], stage, step)
        if step == 0:  # no partial rollouts yet: the whole call, its tail included
            assert stage._slept == pytest.approx(PROFILE.rollout_seconds(lengths))
            stage.partial, stage.partial_span = 0.2, 3
            stage, chunks = _engine(lengths, [len(lengths)], stage, step)
            assert stage._slept < 0.8 * PROFILE.rollout_seconds(lengths)
            assert stage.feed.partial == 0.2
        assert 0 < len(stage._carry) <= 0.2 * (len(lengths) + 10)
        out += [item for chunk in chunks for item in chunk]
    uids = [item["uid"] for item in out]
    assert len(uids) == len(set(uids))  # nothing twice
    first_two = {f"{k}:{i}" for k in (0, 1) for i in range(48)}
    assert first_two <= set(uids)  # span 3: steps 0 and 1 are all out after step 3
    assert max(item.get("lag", 0) for item in out) == 2 and any(item.get("lag") == 1 for item in out)
    assert not {item["uid"] for _, item in stage._carry} & set(uids)  # still decoding: not out
    # the cost model of such an engine ends its time where the engine stops, not at its tail
    model = fit_engine([(1.0, 100, 10)], batches[0], PROFILE.slots)
    cut = replace(model, stop_fraction=0.2)
    assert cut._time(batches[0], []) < 0.8 * model._time(batches[0], [])
    assert cut.spread(48, 4) != model.spread(48, 4)  # a copy predicts anew (no shared memo)


def test_a_partial_engines_model_counts_what_each_step_carries_in() -> None:
    """A heavy tail (20% of responses 4-8x longer) on an engine whose share nearly fills its
    slots: what a step carries in holds slots first, so its last requests start later. The
    model, fitted to one step's reports as the cost model fits it, predicts the engine's mean
    step time over the next ones (12% short before it modelled the carried requests, 25% at
    rev-tight's 24 emulated ranks, where its calibration to the measured mean then put the
    slowest engine 1.3 s late)."""
    from dataclasses import replace

    heavy = replace(PROFILE, slots=32, short=(200, 700), long=(2500, 4000), long_fraction=0.2)
    stage, slept = None, []
    for step in range(300):
        lengths = heavy.lengths(random.Random(100 + step), 30)
        stage, _ = _engine(lengths, [len(lengths)], stage, step, profile=heavy)
        stage.partial, stage.partial_span = 0.2, 3
        if step >= 2:  # a steady state: every step carries some in
            slept.append(stage._slept)
    alpha, decode, slots = heavy.alpha, heavy.decode_step_s, heavy.slots
    model = EngineModel(
        decode * alpha, decode * (1 - alpha) / slots, slots,
        tuple(heavy.lengths(random.Random(7), 600)), draws=64, stop_fraction=0.2,
    )  # fmt: skip
    measured = sum(slept) / len(slept)
    assert model.seconds(30, engines=1) == pytest.approx(measured, rel=0.08)  # 135 s against 127


def test_engine_reports_fit_a_model_that_predicts_other_shares() -> None:
    """What the engine reports (`Feed.progress`), timed as the profile charges it, fits
    `EngineModel` back to the profile: it predicts the engine's time on its own share and on a
    share twice as large, where seconds per item from one share (linear) are far off."""
    lengths = PROFILE.lengths(random.Random(5), 40)
    stage, _ = _engine(lengths, [len(lengths)])
    feed = stage.feed
    assert feed.slots == PROFILE.slots
    assert sorted(n for _, _, done in feed.reports for n in done) == sorted(lengths)
    alpha, step = PROFILE.alpha, PROFILE.decode_step_s
    timed = [(n * step * (alpha + (1 - alpha) * k / PROFILE.slots), n, k) for n, k, _ in feed.reports]
    model = fit_engine(timed, lengths, feed.slots)
    assert model.step_s == pytest.approx(step * alpha)
    assert model.seq_step_s == pytest.approx(step * (1 - alpha) / PROFILE.slots)
    assert model._time(list(lengths), []) == pytest.approx(PROFILE.rollout_seconds(lengths))
    doubled = PROFILE.rollout_seconds(lengths + lengths)
    assert model._time(lengths + lengths, []) == pytest.approx(doubled)
    linear = 2 * PROFILE.rollout_seconds(lengths)
    assert linear > 1.3 * doubled  # what a per-item rate from the first share would predict


def test_memory_bound_is_the_seeds_rule() -> None:
    assert PROFILE.max_micro_batch("rollout") == micro_batch_bound(80e9, 14e9, 0.06e9) == 330
    assert PROFILE.max_micro_batch("reward") is None  # a CPU stage: no device memory to bound


def test_profile_and_components_must_match() -> None:
    with pytest.raises(UserError, match="'embodied' has the stages \\['env', 'policy', 'actor'\\]"):
        load_config(CONFIGS / "emulated_grpo_7b.toml", ["emulation.profile=embodied"])
    near = "'grpo-8b' is not a profile \\(did you mean 'grpo-7b'\\?\\): use a built-in one"
    with pytest.raises(UserError, match=near):
        load_config(CONFIGS / "emulated_grpo_7b.toml", ["emulation.profile=grpo-8b"])


def _emulated_args(run: Path, samples: int, *extra: str) -> list[str]:
    """A 3-step emulated 7B job on 8 ranks (4 rollout ranks, 1 actor rank)."""
    sets = [
        "components.rollout.num_ranks=4", "components.actor.num_ranks=1", "emulation.steps=3",
        f"emulation.samples_per_step={samples}", "emulation.time_scale=0.005", "pipeline.micro_batch=32",
        *extra,
    ]  # fmt: skip
    args = ["run", str(CONFIGS / "emulated_grpo_7b.toml"), "--np", "8", "--run-dir", str(run)]
    return args + [x for item in sets for x in ("--set", item)]


@pytest.mark.parametrize("continuous", [True, False], ids=["engine", "micro-batched"])
def test_emulated_job_streams_responses_and_reports_idle_and_predictions(
    tmp_path: Path, continuous: bool
) -> None:
    run = tmp_path / "run"
    engine = f"emulation.continuous_generation={str(continuous).lower()}"
    result = rlinf(*_emulated_args(run, 256, engine), timeout=240)
    assert result.returncode == 0, result.output
    assert "EMULATION (sleep-costed stages" in result.output
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["emulated"] for r in records)
    for r in records:
        assert 0 < r["idle_fraction"] < 1 and r["coordinator_busy_fraction"] < 0.5 and r["weight_sync_s"] > 0
    assert "predicted_step_s" not in records[0] and records[2]["predicted_step_s"] > 0
    spans = [json.loads(line) for line in (run / "timeline.jsonl").read_text().splitlines()]
    method = "engine" if continuous else "process"
    first_rollout = min((s for s in spans if s["name"] == f"rollout.{method}"), key=lambda s: s["start"])
    first_reward = min(s["start"] for s in spans if s["name"] == "reward.process")
    assert first_reward < first_rollout["end"]  # streamed: scored before its batch was done


def test_one_step_off_policy_generates_the_next_step_while_the_actor_trains(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = _emulated_args(run, 128, "emulation.off_policy_steps=1")
    result = rlinf(*args, timeout=240)
    assert result.returncode == 0, result.output
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_lag"] for r in records] == [0, 1, 1]
    spans = [json.loads(line) for line in (run / "timeline.jsonl").read_text().splitlines()]
    rollout, actor = (
        sorted((s for s in spans if s["name"] == f"{name}.run_stage"), key=lambda s: s["start"])
        for name in ("rollout", "actor")
    )
    rollout = [s for s in rollout if s["rank"] == rollout[0]["rank"]]  # one rollout rank's steps
    assert len(rollout) == len(actor) == 3  # the first step's generation ran before the loop
    for k in (0, 1):  # on-policy, step k+1's generation would start after step k's update
        assert rollout[k + 1]["start"] < actor[k]["end"], (rollout, actor)


def test_auto_places_the_two_off_policy_pipelines_as_one(tmp_path: Path) -> None:
    """placement.mode = "auto" with one-step off-policy: one collocated warm-up of both
    pipelines, one decision over every stage (the trainer's ranks sized to end with generation,
    not to keep pace with it), the step after it measured against the prediction."""
    run = tmp_path / "run"
    sets = ["emulation.off_policy_steps=1", "placement.mode=auto", "emulation.steps=4"]
    result = rlinf(*_emulated_args(run, 128, *sets), timeout=240)
    assert result.returncode == 0, result.output
    assert "(emulated_gen and emulated_train, placed together)" in result.output
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    decided = next(e for e in events if e.get("event") == "auto_placement")
    assert decided["pipelines"] == ["emulated_gen", "emulated_train"]
    assert [p["name"] for p in decided["profiles"]] == ["rollout", "reward", "inference", "actor"]
    shares = decided["ranks_per_phase"]
    assert sorted(shares) == ["actor", "inference", "reward", "rollout"] and sum(shares.values()) == 7
    assert min(shares.values()) >= 1
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_lag"] for r in records] == [0, 1, 1, 1]
    placements = [r["placement"] for r in records]
    assert placements[:2] == ["auto:warm-up (collocated)"] * 2
    assert set(placements[2:]) == {f"auto:{decided['choice']}"}
    measured = next(e for e in events if e.get("event") == "auto_placement_measured")
    assert measured["choice"] == decided["choice"] and measured["measured_s"] > 0


def test_partial_rollouts_train_about_a_steps_samples_with_bounded_lag(tmp_path: Path) -> None:
    """A job with partial rollouts and one-step off-policy (bench_scale's `off_policy_partial`,
    on 8 ranks): from the second step on, some trained responses were begun a step before,
    the recorded lag stays within the bound (1 update for off-policy + at most 2 for a response
    spanning 3 steps), and the rollout engines report what the cost model needs."""
    run = tmp_path / "run"
    sets = [
        "emulation.off_policy_steps=1",
        "emulation.partial_rollouts=0.2",
        "emulation.partial_rollout_steps=3",
    ]
    result = rlinf(*_emulated_args(run, 256, *sets, "emulation.steps=4"), timeout=240)
    assert result.returncode == 0, result.output
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["partial_carried"] == 0 and records[0]["samples_trained"] < 256
    assert all(r["partial_carried"] > 0 and 1 <= r["policy_lag"] <= 3 for r in records[1:])
    assert all(r["samples_trained"] > 0.6 * 256 for r in records[1:])
    assert "predicted_step_s" in records[-2]
    bad = rlinf(*_emulated_args(run, 256, *sets, "emulation.continuous_generation=false"), timeout=60)
    assert bad.returncode == 2 and "carries an engine's unfinished requests" in bad.output, bad.output


def _profile_file(tmp_path: Path, text: str, name: str = "mine.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_profile_file_changes_a_built_in_one_or_defines_its_own_stages(tmp_path: Path) -> None:
    from rlinf_hpc.apps.emulated.profile_file import get_profile

    shipped = get_profile(str(CONFIGS / "profiles" / "grpo-7b-longtail.toml"))
    assert shipped.name == "grpo-7b-longtail" and shipped.long == (1500, 6000)
    code = get_profile(str(CONFIGS / "profiles" / "grpo-code-longtail.toml"))
    assert code.name == "grpo-code-longtail" and code.slots == 48 and code.samples_per_step == 384
    assert code.max_micro_batch("actor") == micro_batch_bound(80e9, 40e9, 0.5e9) == 24

    longer = _profile_file(
        tmp_path,
        'base = "grpo-7b"\nlong = [1500, 6000]\nlong_fraction = 0.03\n'
        "[stages.actor]\nseconds_per_token = 8e-4\n",
    )
    profile = get_profile(str(longer))
    assert profile.name == "mine" and profile.long == (1500, 6000) and profile.long_fraction == 0.03
    assert profile.stages["actor"].seconds_per_token == 8e-4
    assert profile.stages["actor"].finish_s == PROFILE.stages["actor"].finish_s  # the rest is 7B's
    assert profile.stages["actor"].finish_per_sample == 0.0  # a trainer of micro-batches, as built in
    assert list(profile.stages) == list(PROFILE.stages) and profile.slots == PROFILE.slots
    own = _profile_file(
        tmp_path,
        'name = "two-stage"\nsamples_per_step = 64\nsync_to = ["gen"]\n'
        '[stages.gen]\nkind = "generate"\nstate_gb = 10\ngb_per_sample = 0.1\n'
        '[stages.train]\nkind = "per_token"\nseconds_per_token = 1e-4\nfinish_s = 0.5\n',
        "own.toml",
    )
    profile = get_profile(str(own))
    assert list(profile.stages) == ["gen", "train"] and profile.samples_per_step == 64
    assert get_profile(
        str(_profile_file(tmp_path, own.read_text().replace('sync_to = ["gen"]\n', ""), "d.toml"))
    ).sync_to == ("gen",)  # the default: device stages before the trainer
    assert profile.max_micro_batch("gen") == micro_batch_bound(80e9, 10e9, 0.1e9)
    assert PROFILE.train_stages == ("actor",) and profile.train_stages == ("train",)
    critic = get_profile(str(_profile_file(tmp_path, _CRITIC, "critic.toml")))
    assert critic.train_stages == ("actor", "critic") and critic.sync_to == ("rollout", "inference")
    assert get_profile(str(CONFIGS / "profiles" / "ppo-rm-critic.toml")).train_stages == ("actor", "critic")
    named = tmp_path / "named.toml"
    named.write_text('trainers = ["critic"]\n' + _CRITIC)
    assert get_profile(str(named)).train_stages == ("critic",)
    # a profile of its own without sync_to: the device stages before the trainers get the weights
    own_critic = _profile_file(
        tmp_path,
        'samples_per_step = 8\n[stages.gen]\nkind = "generate"\n[stages.score]\nkind = "per_sample"\n'
        'on_device = false\n[stages.actor]\nkind = "per_token"\nfinish_s = 1.0\n'
        '[stages.critic]\nkind = "per_token"\nfinish_s = 0.5\n',
        "own_critic.toml",
    )
    assert get_profile(str(own_critic)).sync_to == ("gen",)
    every = own_critic.read_text().replace('kind = "generate"\n', 'kind = "generate"\nfinish_s = 0.1\n')
    own_critic.write_text(every.replace("on_device = false\n", "on_device = false\nfinish_s = 0.1\n"))
    assert get_profile(str(own_critic)).train_stages == ("score", "actor", "critic")  # not the generator


#: The 7B step with a PPO critic after the actor (both train: both have an optimizer step).
_CRITIC = (
    'base = "grpo-7b"\n[stages.critic]\nkind = "per_token"\nseconds_per_token = 2e-4\n'
    "finish_s = 0.5\nstate_gb = 10\n"
)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('base = "grpo-7b"\nslot = 32\n', "unknown key 'slot' (did you mean 'slots'?)"),
        (
            'base = "grpo-7b"\n[stages.actor]\nseconds_per_tokn = 1\n',
            "did you mean 'stages.actor.seconds_per_token'",
        ),
        ('base = "grpo-7b"\n[stages.extra]\nseconds_per_call = 1\n', "stages.extra needs a kind"),
        ('base = "grpo-7b"\n[stages.actor]\nkind = "train"\n', "stages.actor.kind must be one of generate"),
        ('base = "grpo-7b"\nlong = [2000, 1500]\n', "long must be [low, high] with 1 <= low <= high"),
        ('base = "grpo-7b"\nalpha = 1.5\n', "alpha must be a number from 0 to 1"),
        ('base = "grpo-7b"\n[stages.actor]\nfinish_per_sample = -1\n', "finish_per_sample must be a number"),
        ('base = "grpo-7b"\ndecode_step_s = 0\n', "decode_step_s must be a number > 0"),
        ('base = "grpo-7b"\nsync_to = ["rolout"]\n', "sync_to names 'rolout', which is not a stage"),
        ('base = "grpo-7b"\ntrainers = ["actr"]\n', "trainers names 'actr', which is not a stage"),
        ('base = "grpo-7b"\ntrainers = ["inference"]\n', "must be the step's last stages, in order"),
        ('base = "grpo-7b"\n[stages.actor]\nstate_gb = 90\n', "does not fit the device"),
        ('base = "grpo-9b"\n', "base = 'grpo-9b' is not a built-in profile"),
        ("samples_per_step = 8\n", "no stages"),
        ("base = \n", "not valid TOML"),
    ],
)
def test_a_bad_profile_file_is_named_with_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    from rlinf_hpc.apps.emulated.profile_file import ProfileError, get_profile

    path = _profile_file(tmp_path, text)
    with pytest.raises(ProfileError) as error:
        get_profile(str(path))
    assert message in str(error.value) and str(path) in str(error.value)


def _job_config(tmp_path: Path, name: str, profile: Path, stages: list[str], emulation: str = "") -> Path:
    """A 3-step disaggregated emulated job on ``profile``: one rank per stage, components named
    after the stages; ``emulation``: more lines of its [emulation] table."""
    worker = 'worker = "rlinf_hpc.apps.emulated.workers:EmulatedStage"\n'
    config = tmp_path / "job.toml"
    config.write_text(
        f'[job]\nname = "{name}"\nnum_ranks = {len(stages) + 1}\n'
        + "".join(f"[components.{stage}]\n{worker}" for stage in stages)
        + '[placement]\nmode = "disaggregated"\n'
        f'[emulation]\nprofile = "{profile}"\nsteps = 3\ntime_scale = 0.005\n{emulation}'
        '[flow]\nrunner = "emulated_rl"\n'
    )
    return config


def test_a_job_runs_a_profile_of_ones_own_and_a_bad_one_stops_before_any_rank_starts(tmp_path: Path) -> None:
    """A two-stage profile whose stages are not the built-ins' names (the trainer is the last
    stage, whatever its name); the config names its components after it."""
    own = _profile_file(
        tmp_path,
        'name = "two-stage"\nsamples_per_step = 64\nsync_to = ["gen"]\nslots = 16\n'
        '[stages.gen]\nkind = "generate"\nstate_gb = 10\ngb_per_sample = 0.1\n'
        '[stages.train]\nkind = "per_token"\nseconds_per_token = 1e-4\nfinish_s = 0.5\nstate_gb = 20\n',
        "own.toml",
    )
    config = _job_config(tmp_path, "own", own, ["gen", "train"])
    run = tmp_path / "run"
    result = rlinf("run", str(config), "--run-dir", str(run), timeout=240)
    assert result.returncode == 0, result.output
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["profile"] for r in records] == ["two-stage"] * 3
    assert set(records[-1]["phases_s"]) == {"gen", "train"} and records[-1]["weight_sync_s"] > 0
    own.write_text(own.read_text().replace("slots = 16", "slots = 0"))
    bad = rlinf("run", str(config), "--run-dir", str(tmp_path / "bad"), timeout=60)
    assert bad.returncode == 2 and "slots must be a whole number >= 1, got 0" in bad.output, bad.output
    assert "Traceback" not in bad.output


def test_off_policy_trains_a_critic_after_the_actor_beside_generation_and_syncs_the_actors_weights(
    tmp_path: Path,
) -> None:
    """A profile whose critic follows the actor: both are the training pipeline off-policy (the
    actor was left in the generation pipeline when the trainer was taken to be the last stage),
    and the policy weights come from the actor, not the critic."""
    profile = _profile_file(tmp_path, _CRITIC, "critic.toml")
    stages = [*PROFILE.stages, "critic"]
    config = _job_config(tmp_path, "critic", profile, stages, "samples_per_step = 64\noff_policy_steps = 1\n")
    run = tmp_path / "run"
    result = rlinf("run", str(config), "--run-dir", str(run), timeout=240)
    assert result.returncode == 0, result.output
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_lag"] for r in records] == [0, 1, 1]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    pipelines = {
        e["pipeline"]: [s["component"] for s in e["stages"]] for e in events if e["event"] == "pipeline_step"
    }
    assert pipelines == {
        "emulated_gen": ["rollout", "reward", "inference"],
        "emulated_train": ["actor", "critic"],
    }
    spans = {json.loads(line)["name"] for line in (run / "timeline.jsonl").read_text().splitlines()}
    assert "actor.send_weights" in spans and "critic.send_weights" not in spans, sorted(spans)
