"""Checkpoint-restart of the math GRPO job end to end: a run interrupted (SIGKILL of a worker
mid-step, SIGUSR2, at an epoch boundary of the data; disaggregated, collocated with a full
switch, auto) and resumed ends bitwise equal to one never interrupted; bad checkpoints and
directories are refused or skipped with a clear message."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rlinf_hpc.errors import EXIT_SAVED_AND_STOPPED
from rlinf_hpc.runtime.checkpoint import read_state
from rlinf_hpc.runtime.checkpoint.store import open_checkpoint
from rlinf_hpc.runtime.disk import EXIT_DISK_FULL

from conftest import CONFIGS, TINY, job_env, rlinf

STEPS = 6
BASE = [
    *[s for s in TINY if not s.startswith(("grpo.steps=", "flow.runner="))],
    f"grpo.steps={STEPS}",
    "checkpoint.every_steps=2",
    "flow.runner=job_workers:GRPO_INTERRUPT",
    # elastic micro-batches, the default: their sizes follow timing (a resumed run's differ from
    # an uninterrupted one's), and batch-invariant forwards keep every number independent of them
]
#: Record fields that measure time (or follow timing, like elastic sizes), not learning.
TIMING = {"step_s", "tokens_per_s", "weight_sync_s", "phases_s", "switch_s", "bubble_fraction", "micro_batch"}

SCENARIOS = {
    "disaggregated": (5, []),
    "collocated": (2, ["placement.mode=collocated", "placement.switch=full"]),
    # the next step's samples, generated beside the update, are part of the checkpoint
    "off_policy": (5, ["grpo.off_policy_steps=1"]),
}
AUTO = (5, ["placement.mode=auto", "placement.auto_warmup_steps=1"])
#: Every component on one worker rank, for the checks that do not depend on the placement: a
#: job of 2 ranks starts in less than half the CPU time of 5 (each rank imports torch).
ONE = ["placement.mode=collocated"]


def _job(run_dir: Path, np: int, sets: list[str], *extra: str) -> object:
    args = ["run", str(CONFIGS / "math_grpo_tiny.toml"), "--np", str(np), "--run-dir", str(run_dir), *extra]
    for item in sets:
        args += ["--set", item]
    return rlinf(*args, timeout=360)


def _interrupt(how: str, after: int, victim: str = "actor") -> list[str]:
    return [f'flow.options={{interrupt="{how}", after_step={after}, victim="{victim}"}}']


def _final(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("step-*[0-9]"))[-1]


def _assert_same_state(a: Path, b: Path) -> None:
    """Every worker file of the two final checkpoints holds bitwise-equal tensors and values
    (but the elastic micro-batch sizes: they follow timing, and results do not depend on them)."""
    names = sorted(p.stem for p in a.glob("*-g*.json"))
    assert names and names == sorted(p.stem for p in b.glob("*-g*.json"))
    for name in names:
        x, y = read_state(a, name), read_state(b, name)
        for state in (x, y):
            state.get("runtime", {}).pop("stage_sizes", None)
        _assert_equal(x, y, name)


def _assert_equal(x: object, y: object, path: str) -> None:
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape, path
        assert torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)), f"{path} differs"
    elif isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), path
        for key in x:
            _assert_equal(x[key], y[key], f"{path}.{key}")
    elif isinstance(x, (list, tuple)):
        assert type(x) is type(y) and len(x) == len(y), path
        for i, (p, q) in enumerate(zip(x, y, strict=True)):
            _assert_equal(p, q, f"{path}[{i}]")
    elif hasattr(x, "tobytes"):
        assert x.tobytes() == y.tobytes(), f"{path} differs"  # type: ignore[attr-defined]
    else:
        assert x == y, f"{path}: {x!r} != {y!r}"


def _metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


class _References:
    """Uninterrupted runs, one per scenario (the interruption point is never reached), each run
    when a test first asks for it (a scenario left out of the run costs nothing)."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.runs: dict[str, Path] = {}

    def __getitem__(self, name: str) -> Path:
        if name not in self.runs:
            np, sets = SCENARIOS[name]
            run_dir = self.factory.mktemp(f"reference-{name}") / "run"
            result = _job(run_dir, np, [*BASE, *sets, *_interrupt("none", 0)])
            assert result.returncode == 0, result.output
            self.runs[name] = run_dir
        return self.runs[name]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> _References:
    return _References(tmp_path_factory)


@pytest.mark.parametrize(
    ("scenario", "how", "after", "resumed_from"),
    [
        ("disaggregated", "kill", 3, 2),  # killed in step 4; step 2's save was committed at 3
        # collocated resumes: the epoch-boundary and bad-checkpoint tests (one worker rank), and
        # the embodied resume into another placement; this one adds DDP over 2 ranks (1 min)
        pytest.param("collocated", "kill", 3, 2, marks=pytest.mark.slow),
        pytest.param("off_policy", "kill", 3, 2, marks=pytest.mark.slow),  # 3.6 min on a slow box
        # SIGUSR2: on disaggregated ranks in the SLURM requeue test, on auto in the last test here
    ],
)
def test_interrupted_run_resumes_bitwise_equal(
    tmp_path: Path, references: _References, scenario: str, how: str, after: int, resumed_from: int
) -> None:
    np, sets = SCENARIOS[scenario]
    run_dir = tmp_path / "run"
    sets = [*BASE, *sets, *_interrupt(how, after)]
    first = _job(run_dir, np, sets)
    if how == "usr2":
        assert first.returncode == EXIT_SAVED_AND_STOPPED, first.output
        assert "saved step 3 and stopped (signal SIGUSR2)" in first.output
        assert json.loads((run_dir / "summary.json").read_text())["outcome"] == "checkpointed"
    else:
        assert first.returncode != 0, first.output
    assert len(_metrics(run_dir)) >= after  # the stopped run got at least that far
    second = _job(run_dir, np, sets)
    assert second.returncode == 0, second.output
    assert f"(step {resumed_from}, saved for:" in second.output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_step"] == resumed_from and summary["outcome"] == "ok"
    _assert_same_state(_final(references[scenario]), _final(run_dir))
    assert _metrics(run_dir) == _metrics(references[scenario])  # no gaps, no duplicates


def test_a_sigterm_with_a_grace_saves_the_next_step_boundary_and_the_resume_ends_equal(
    tmp_path: Path, references: _References
) -> None:
    """``checkpoint.sigterm_save_s``: scancel's SIGTERM (every rank gets it) mid-step saves the
    step it lands in, stops with exit 3 and is not requeued; the resume ends bitwise equal."""
    np, sets = SCENARIOS["disaggregated"]
    run_dir = tmp_path / "run"
    sets = [*BASE, *sets, "checkpoint.sigterm_save_s=30", *_interrupt("term", 3)]
    first = _job(run_dir, np, sets)
    assert first.returncode == EXIT_SAVED_AND_STOPPED, first.output
    saved = re.search(r"saved step (\d+) and stopped \(signal SIGTERM\)", first.output)
    assert saved and int(saved.group(1)) in (4, 5), first.output  # the step it landed in (or the next)
    assert "received SIGTERM: saving the next step boundary" in first.output, first.output
    assert json.loads((run_dir / "summary.json").read_text())["outcome"] == "checkpointed"
    second = _job(run_dir, np, sets)
    assert second.returncode == 0, second.output
    assert f"(step {saved.group(1)}, saved for: signal SIGTERM)" in second.output, second.output
    _assert_same_state(_final(references["disaggregated"]), _final(run_dir))
    assert _metrics(run_dir) == _metrics(references["disaggregated"])  # no gaps, no duplicates


def test_a_sigterm_whose_grace_ends_before_a_step_boundary_stops_as_without_one(tmp_path: Path) -> None:
    """Past ``checkpoint.sigterm_save_s`` the job stops as a SIGTERM always did (143), saving
    nothing more; the periodic checkpoint stays the one to resume from."""
    np, sets = SCENARIOS["disaggregated"]
    run_dir = tmp_path / "run"
    first = _job(run_dir, np, [*BASE, *sets, "checkpoint.sigterm_save_s=0.001", *_interrupt("term", 3)])
    assert first.returncode == 143, first.output
    assert "saved step" not in first.output and "stopping every rank" in first.output, first.output
    assert [p.name for p in sorted((run_dir / "checkpoints").glob("step-*[0-9]"))] == ["step-00000002"]


def test_resume_at_an_epoch_boundary_of_the_data(tmp_path: Path) -> None:
    """16 training problems, 8 per step: step 2 ends epoch 0; the resume starts epoch 1."""
    data = tmp_path / "data"
    data.mkdir()
    for split, count in (("train", 16), ("eval", 8)):
        rows = [{"question": f"{i}+{i % 3}=", "answer": f"#### {i + i % 3}"} for i in range(count)]
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = [
        "task.kind=jsonl",
        "sft.teacher=exact",  # the careless teacher writes sums only
        f"task.train_path={data / 'train.jsonl'}",
        f"task.eval_path={data / 'eval.jsonl'}",
    ]
    sets = [*BASE, *ONE, *task, "grpo.steps=4"]
    reference = _job(tmp_path / "reference", 2, [*sets, *_interrupt("none", 0)])
    assert reference.returncode == 0, reference.output
    run_dir = tmp_path / "run"
    first = _job(run_dir, 2, [*sets, *_interrupt("usr2", 2)])
    assert first.returncode == EXIT_SAVED_AND_STOPPED, first.output
    second = _job(run_dir, 2, [*sets, *_interrupt("usr2", 2)])
    assert second.returncode == 0 and "(step 2, saved for: signal SIGUSR2)" in second.output, second.output
    _assert_same_state(_final(tmp_path / "reference"), _final(run_dir))
    assert _metrics(run_dir) == _metrics(tmp_path / "reference")


def test_bad_checkpoints_are_skipped_or_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    sets = [*BASE, *ONE, "grpo.steps=4", *_interrupt("none", 0)]
    assert _job(run_dir, 2, sets).returncode == 0
    root = run_dir / "checkpoints"
    assert [p.name for p in sorted(root.glob("step-*"))] == ["step-00000002", "step-00000004"]
    # corrupt the newest: auto skips it with a warning naming it, and resumes from step 2
    actor = root / "step-00000004" / "actor-g0.safetensors"
    blob = bytearray(actor.read_bytes())
    blob[-1] ^= 0xFF
    actor.write_bytes(bytes(blob))
    (root / "step-00000006.tmp").mkdir()  # a save that never finished
    resumed = _job(run_dir, 2, sets)
    assert resumed.returncode == 0, resumed.output
    assert (
        "skipping checkpoint" in resumed.output
        and "step-00000004: actor-g0.safetensors does not match" in (resumed.output)
    )
    assert "(step 2, saved for: periodic)" in resumed.output
    # an explicit PATH that is not a checkpoint: exit 2, one paragraph
    for path, message in ((tmp_path, "holds no complete checkpoint"), (tmp_path / "nope", "does not exist")):
        bad = _job(run_dir, 2, sets, "--resume", str(path))
        assert bad.returncode == 2 and f"--resume {path} is not a usable checkpoint" in bad.output, bad.output
        assert message in bad.output and "Traceback" not in bad.output
    # a different config: refused, naming the keys; model keys refused even with --force-resume
    changed = _job(run_dir, 2, [*sets, "grpo.lr=0.5"])
    assert changed.returncode == 2 and "grpo.lr: 0.0001 -> 0.5" in changed.output, changed.output
    forced = _job(run_dir, 2, [*sets, "grpo.lr=0.5"], "--force-resume")
    assert forced.returncode == 0, forced.output
    model = _job(run_dir, 2, [*sets, "model.hidden_size=64", "model.num_heads=4"], "--force-resume")
    assert (
        model.returncode == 2 and "model.hidden_size" in model.output and "cannot be loaded" in model.output
    )


def test_checkpoint_directory_problems_stop_the_job_at_start(tmp_path: Path) -> None:
    sets = [*BASE, *ONE, "grpo.steps=2", *_interrupt("none", 0)]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    unwritable = _job(tmp_path / "run", 2, [*sets, f"checkpoint.dir={blocker / 'ckpt'}"])
    assert unwritable.returncode == 2 and "cannot be written" in unwritable.output, unwritable.output
    assert "warm start" not in unwritable.output
    # a live job's lock: this test's own process stands in for the other job
    root = tmp_path / "shared"
    root.mkdir()
    owner = {"job_id": None, "host": os.uname().nodename, "pid": os.getpid(), "since": time.time()}
    (root / "LOCK").write_text(json.dumps(owner))
    locked = _job(tmp_path / "run2", 2, [*sets, f"checkpoint.dir={root}"])
    assert locked.returncode == 2 and f"pid {os.getpid()}" in locked.output, locked.output
    # a lock left by a process that is gone is taken over
    owner["pid"] = 2**22 + 12345
    (root / "LOCK").write_text(json.dumps(owner))
    taken = _job(tmp_path / "run3", 2, [*sets, f"checkpoint.dir={root}"])
    assert taken.returncode == 0, taken.output
    assert not (root / "LOCK").exists()  # released at the end


def test_deadline_is_anchored_to_the_allocation_not_to_process_start(tmp_path: Path) -> None:
    """An allocation that began an hour ago and ends in 45 s: the job saves and stops before
    its end although the process has only just started (SLURM's clock from the environment;
    Hydra forks the ranks locally as the job id is made up). 45 s: on a slow, busy 2-core box
    the two ranks take ~25 s to start, and a deadline inside start-up is not this test's case."""
    now = int(time.time())
    clock = {"SLURM_JOB_START_TIME": str(now - 3600), "SLURM_JOB_END_TIME": str(now + 45)}
    env = job_env({"SLURM_JOB_ID": "987654", "HYDRA_BOOTSTRAP": "fork", **clock})
    sets = [*BASE, *ONE, "grpo.steps=5000", "grpo.eval_every=1000", "checkpoint.deadline_margin_s=1",
            "checkpoint.requeue=false", *_interrupt("none", 0)]  # fmt: skip
    args = ["run", str(CONFIGS / "math_grpo_tiny.toml"), "--np", "2", "--run-dir", str(tmp_path / "run")]
    result = rlinf(*args, *[x for s in sets for x in ("--set", s)], timeout=120, env=env)
    assert result.returncode == EXIT_SAVED_AND_STOPPED, result.output
    assert "(allocation deadline (" in result.output
    stopped = json.loads((tmp_path / "run" / "summary.json").read_text())["flow_result"]["stopped_after_step"]
    assert 0 < stopped < 5000
    final = _final(tmp_path / "run")
    assert final.name == f"step-{stopped:08d}"
    assert json.loads((final / "manifest.json").read_text())["created"] < now + 45  # saved in time


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 1 MB tmpfs: room for two checkpoints of the tiny job, not three (root only)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.decode().strip()})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_keeps_the_previous_checkpoint_and_says_so(tmp_path: Path, small_disk: Path) -> None:
    sets = [
        *BASE,
        *ONE,
        "grpo.steps=6",
        f"checkpoint.dir={small_disk}",
        "checkpoint.keep=2",
        *_interrupt("none", 0),
    ]
    result = _job(tmp_path / "run", 2, sets)
    assert "No space left on device" in result.output, result.output
    assert "the newest complete checkpoint (" in result.output and "is intact" in result.output
    # the final save (step 6) did not fit: the job stops with its own exit code, naming the disk
    assert result.returncode == EXIT_DISK_FULL, result.output
    assert "checkpoint of step 6 failed" in result.output and "Traceback" not in result.output
    culprit = json.loads((tmp_path / "run" / "summary.json").read_text())["culprit"]
    assert culprit["cause"] == "disk_full" and culprit["path"] == str(small_disk), culprit
    assert isinstance(culprit["free_bytes"], int), culprit
    complete = sorted(p.name for p in small_disk.glob("step-*[0-9]"))
    assert complete == ["step-00000002", "step-00000004"] and not list(small_disk.glob("step-*.tmp"))
    for name in complete:  # what is there is whole
        open_checkpoint(small_disk / name)
    # a save left unfinished (a kill mid-save) is said and removed at the resume; one given as
    # --resume PATH is refused, naming the newest complete checkpoint
    (small_disk / "step-00000099.tmp").mkdir()
    refused = _job(tmp_path / "run", 2, sets, "--resume", str(small_disk / "step-00000099.tmp"))
    assert refused.returncode == 2 and "is a save that did not finish" in refused.output, refused.output
    assert f"the newest in {small_disk} is {small_disk / 'step-00000004'}" in refused.output
    # no room for one more checkpoint: refused at the start, with the numbers
    full = _job(tmp_path / "run", 2, sets)
    assert full.returncode == 2 and "less than one checkpoint of this job (0.3 MB" in full.output, full.output
    assert f"removing {small_disk / 'step-00000099.tmp'}: a save that did not finish" in full.output
    shutil.rmtree(small_disk / "step-00000002")  # room made, as the message says
    resumed = _job(tmp_path / "run", 2, [*sets, "grpo.steps=4"])
    assert not list(small_disk.glob("step-*.tmp")) and resumed.returncode == 0, resumed.output


def test_a_run_directory_that_fills_up_goes_on_without_checkpoints_then_stops_named(
    tmp_path: Path, small_disk: Path
) -> None:
    """The run directory itself on a small disk: heartbeats, events and metrics share it with
    checkpoints that stop fitting. Saves that cannot fit are not started, training goes on, and
    when the disk is filled from outside too the job stops: exit 28, culprit disk_full."""
    sets = [
        *BASE,
        *ONE,
        "grpo.steps=6",
        "checkpoint.every_steps=1",
        "checkpoint.keep=100",
        *_interrupt("none", 0),
    ]
    run_dir = small_disk / "run"
    result = _job(run_dir, 2, sets)
    assert "not started" in result.output and "the next is tried at the next interval" in result.output, (
        result.output
    )
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    steps = [e["step"] for e in events if e["event"] == "pipeline_step"]
    assert steps == [1, 2, 3, 4, 5, 6], steps  # every step trained, none lost from the records
    assert [e["culprit"]["cause"] for e in events if e["event"] == "end"] == ["disk_full"], events[-1]
    assert result.returncode == EXIT_DISK_FULL and "Traceback" not in result.output, result.output


@pytest.mark.slow  # 1.6 min on a slow box
def test_more_data_parallel_actor_ranks_load_the_replicated_state(tmp_path: Path) -> None:
    """DDP state is replicated: a checkpoint of one actor rank resumes on two (with the
    warning that the new rank's RNG starts fresh)."""
    run_dir = tmp_path / "run"
    sets = [*BASE, *_interrupt("none", 0)]
    assert _job(run_dir, 5, [*sets, "grpo.steps=2"]).returncode == 0
    wider = _job(run_dir, 6, [*sets, "grpo.steps=4", "components.actor.num_ranks=2"])
    assert wider.returncode == 0, wider.output
    assert (
        "component 'actor' had 1 rank(s), now 2" in wider.output
        and "(step 2, saved for: end)" in wider.output
    )
    manifest = json.loads((_final(run_dir) / "manifest.json").read_text())
    assert manifest["step"] == 4
    assert manifest["components"]["actor"] == {"ranks": 2, "replicated": True, "reshardable": False}


@pytest.mark.slow  # four 6-rank jobs: over 4 min on a slow box
@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed (DS_BUILD_OPS=0 pip install deepspeed)",
)
def test_deepspeed_zero2_actor_resumes_bitwise_equal_and_refuses_other_rank_counts(tmp_path: Path) -> None:
    zero = [
        "components.actor.num_ranks=2",
        "grpo.train_backend=deepspeed",
        "grpo.zero_stage=2",
        "grpo.steps=4",
    ]
    reference = _job(tmp_path / "reference", 6, [*BASE, *zero, *_interrupt("none", 0)])
    assert reference.returncode == 0, reference.output
    # the reference is the check that ZeRO-2 over two actor ranks trains and syncs the policy
    line = next(x for x in reference.output.splitlines() if x.startswith("DIGESTS "))
    digests = json.loads(line[len("DIGESTS ") :])
    assert len(digests["actor"]) == 2 and len(set(digests["actor"])) == 1
    assert set(digests["rollout"]) == set(digests["actor"]) == set(digests["inference"])
    run_dir = tmp_path / "run"
    first = _job(run_dir, 6, [*BASE, *zero, *_interrupt("usr2", 2)])
    assert first.returncode == EXIT_SAVED_AND_STOPPED, first.output
    narrower = _job(run_dir, 5, [*BASE, *zero, *_interrupt("usr2", 2), "components.actor.num_ranks=1"])
    assert narrower.returncode == 2, narrower.output
    assert "per-rank state of component 'actor' for 2 rank(s); this job gives it 1" in narrower.output
    second = _job(run_dir, 6, [*BASE, *zero, *_interrupt("usr2", 2)])
    assert second.returncode == 0, second.output
    _assert_same_state(_final(tmp_path / "reference"), _final(run_dir))  # both ZeRO partitions


def _auto_stopped_and_resumed(tmp_path: Path, np: int, sets: list[str], force: str) -> tuple[Any, Any]:
    """An auto job whose choice is forced (`force_auto`) run uninterrupted in
    ``tmp_path/reference``, and in ``tmp_path/run`` stopped by SIGUSR2 after step 3 then
    resumed: the stopped and the resumed run's results."""
    option = f'flow.options={{{{interrupt="{{}}", after_step={{}}, force_auto="{force}"}}}}'
    reference = _job(tmp_path / "reference", np, [*BASE, *sets, option.format("none", 0)])
    assert reference.returncode == 0, reference.output
    first = _job(tmp_path / "run", np, [*BASE, *sets, option.format("usr2", 3)])
    assert first.returncode == EXIT_SAVED_AND_STOPPED, first.output
    second = _job(tmp_path / "run", np, [*BASE, *sets, option.format("usr2", 3)])
    assert second.returncode == 0, second.output
    return first, second


@pytest.mark.slow  # three auto jobs: 2.9 min on a slow box (off-policy: ~4)
@pytest.mark.parametrize("off_policy", [False, True], ids=["on-policy", "off-policy"])
def test_auto_resumed_after_it_split_the_ranks_takes_its_placement_back(
    tmp_path: Path, off_policy: bool
) -> None:
    """auto decided "disaggregated" (forced: the tiny job's phases favour collocated) and
    repartitioned; the resume repartitions to the saved groups before loading, re-measures
    nothing, and ends bitwise equal. Off-policy: the two pipelines were placed as one, and the
    samples generated ahead are in the checkpoint."""
    np, sets = AUTO
    sets = [*sets, f"grpo.off_policy_steps={int(off_policy)}"]
    sets = [*sets, "placement.auto_verify_steps=0"]  # kept, whatever the split measures
    _, second = _auto_stopped_and_resumed(tmp_path, np, sets, "disaggregated")
    run_dir = tmp_path / "run"
    assert "auto: warm-up step" not in second.output
    placements = [m["placement"] for m in _metrics(run_dir)]
    assert placements[0].startswith("auto:warm-up") and set(placements[1:]) == {"auto:disaggregated"}
    _assert_same_state(_final(tmp_path / "reference"), _final(run_dir))
    assert _metrics(run_dir) == _metrics(tmp_path / "reference")


def test_auto_moves_back_when_the_split_measures_slower_and_the_joiners_take_the_trained_state(
    tmp_path: Path,
) -> None:
    """auto split the ranks (forced) and the split measured slower than the collocated warm-up
    (forced): it moves every component back to every worker rank. The ranks that join the actor
    take the state of the one that trained (weights and Adam moments: the optimizer's step count
    is every update's), inference's joiners its reference policy, rollout and inference the
    actor's weights; the job trains on to the end and checkpoints the collocated placement."""
    np, sets = AUTO
    option = 'flow.options={interrupt="none", after_step=0, force_auto="revert"}'
    run = _job(tmp_path / "run", np, [*BASE, *sets, option])
    assert run.returncode == 0, run.output
    assert "moved back to collocated" in run.output
    placements = [m["placement"] for m in _metrics(tmp_path / "run")]
    assert placements == ["auto:warm-up (collocated)"] + ["auto:disaggregated"] * 3 + ["auto:collocated"] * 2
    line = next(x for x in run.output.splitlines() if x.startswith("DIGESTS "))
    digests = json.loads(line[len("DIGESTS ") :])
    assert len(digests["actor"]) == 4 and len(set(digests["actor"])) == 1, digests
    assert set(digests["rollout"]) == set(digests["inference"]) == set(digests["actor"]), digests
    final = _final(tmp_path / "run")
    steps = STEPS * 2 * 2  # grpo.update_epochs x grpo.minibatches optimizer steps per update
    states = [read_state(final, p.stem)["state"] for p in sorted(final.glob("actor-g*.json"))]
    kept = [state for state in states if state is not None]  # DDP: the group's first rank saves
    assert len(states) == 4 and kept, states
    for state in kept:
        assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {steps}
    assert read_state(final, "coordinator")["groups"]["actor"] == [1, 2, 3, 4]


@pytest.mark.slow  # three 5-rank jobs (~50-60 s) beside the rest of CI made its MPI starts flaky
def test_a_run_stopped_while_auto_measures_its_move_resumes_it_and_ends_equal(tmp_path: Path) -> None:
    """Stopped (SIGUSR2) one step into the two that measure auto's split: the resume takes the
    split back, measures the one step left, moves back like the uninterrupted run, and ends
    bitwise equal to it."""
    np, sets = AUTO
    first, second = _auto_stopped_and_resumed(tmp_path, np, sets, "revert")
    run_dir = tmp_path / "run"
    assert "moved back" not in first.output
    assert "moved back to collocated" in second.output and "auto: warm-up step" not in second.output
    assert _metrics(run_dir) == _metrics(tmp_path / "reference")
    _assert_same_state(_final(tmp_path / "reference"), _final(run_dir))
