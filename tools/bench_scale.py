#!/usr/bin/env python
"""M2Flow at cluster scale on a small box — EMULATED accelerators (``emulated_rl`` app).

    python tools/bench_scale.py [--json PATH] [--png PATH] [--ranks 8,16,32]
                                [--profile grpo-7b|FILE.toml] [--others grpo-1.5b,...]
                                [--others-ranks 16] [--steps 5] [--time-scale 0.01] [--quick]

Every stage sleeps what a real device would spend (rlinf_hpc/apps/emulated/profiles.py:
long-tailed generation with continuous batching, log-probs, training, weight sync, light/full
context switches, device memory), so the *real* runtime — coordinator, channels, elastic
micro-batches, time-share, auto placement — runs at 8-32 ranks without the ranks competing for
the box's cores. It is an emulation: the figures say what the runtime does with such costs, not
what a GPU cluster measures.

Modes, each a separate job on the same ranks (the coordinator + W workers) and the same
responses (lengths are a function of seed and step):

* ``centralized``: every stage on every worker, one after the other, the whole batch at once
  in equal shards (fixed micro-batch = the batch, round-robin) — a veRL-style colocated trainer;
* ``fixed_pipeline``: stages on disjoint ranks (split in proportion to their work), fixed
  micro-batches of ``--micro-batch``, one generate call per micro-batch — a pipeline without
  elastic sizing; ``fixed_engine`` (reported): the same with our continuous generation engine,
  to tell what the engine alone gives from what elastic sizing adds;
* ours: ``disaggregated``, ``collocated`` and ``hybrid`` with elastic micro-batches and a
  continuous generation engine per rollout rank (requests join as slots free, responses stream
  on), and ``auto`` (two collocated warm-up steps, then the cost model's choice);
* ``off_policy``: ``disaggregated`` with one-step off-policy (the actor trains on step t's
  samples while the other stages produce step t+1's); ``off_policy_fixed``: the same with the
  fixed pipeline's micro-batches (the off-policy effect without the elastic controller's);
  ``off_policy_auto``: one-step off-policy with ``auto``, which places the two pipelines as one
  (a collocated warm-up of both, then the split whose longer pipeline is shortest:
  `rank_split.predict_ahead`) instead of taking the on-policy hand split;
* ``off_policy_partial``: ``hybrid`` — every stage before the trainer on shared ranks, the
  trainer on its own — with one-step off-policy and **partial rollouts** (an engine stops when
  20% of its step's requests still decode and goes on with them next step; a response spans at
  most 3 steps): it does not wait for the long tail, and trains on responses up to 3 updates
  stale; ``partial`` (not in the default ``--modes``): the same, on-policy.
  These modes change the algorithm (staleness, recorded as ``lag``), so they are judged apart.

Per mode: mean step time (steps after the first two but the last; auto: after its warm-up and
the first decided step; off-policy's first step also generates its samples, its last only
trains; the pipelines' clock, from the step's stream declarations, and the weight sync), the
**wall** time between the steps' records (also the flow's own bookkeeping: 2-5% more at 32
ranks, about the same in every mode; the ratios use the step time), idle fraction of the worker
ranks, the coordinator's CPU share, and the cost model's predicted step time (calibrated on the
step before) next to the measured one.
Ratios (on ``--profile`` at the largest and the middle rank count): ``best_vs_centralized``,
``best_vs_fixed_pipeline`` (>= 1.5, >= 1.3: the best of our on-policy modes, ``auto`` among them
— what a user runs; before 2026-12-07 the best manual one), ``auto_vs_best`` (>= 0.95: against
the best *manual* mode), ``cost_model_error`` (<= 0.10: the largest relative error over modes and rank
counts), ``idle_vs_centralized`` (<= 0.5: the best mode's idle fraction / centralized's),
``off_policy_vs_on_policy`` (>= 1.3: disaggregated's step time / off_policy's),
``off_policy_auto_vs_on_policy`` (the best on-policy mode's step / off_policy_auto's), and
beside them (reported) ``off_policy_fixed_vs_fixed_pipeline``; for the stale modes
``off_policy_partial_vs_on_policy`` (>= 1.3: the best on-policy mode's step / its),
``stale_best_vs_centralized`` (>= 1.5) and ``stale_idle_vs_centralized`` (<= 0.5). Per rank
count the table also shows the on-policy **floor** (`Profile.on_policy_floor_s`: the step's
longest response decoded alone, then through every later stage, the optimizer step and the
weight sync, on ideal devices) and the **ceiling** of ``best_vs_centralized``: centralized's
step over the larger of the floor and the step with no idle time at all (its work at full
efficiency spread evenly over the workers) — both bounds on ideal devices, so no on-policy
placement gains more, whatever the runtime does. On the 7B profile the floor binds from ~32
ranks on, the work below that.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import check_ratios, plot_curves, write_json

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rlinf_hpc.apps.emulated.profile_file import ProfileError, get_profile  # noqa: E402
from rlinf_hpc.apps.emulated.profiles import PROFILES, Profile  # noqa: E402
from rlinf_hpc.scheduler.cost_model import PhaseProfile  # noqa: E402
from rlinf_hpc.scheduler.rank_split import split_ranks  # noqa: E402

REQUIRED = {
    "best_vs_centralized": (">=", 1.5),
    "best_vs_fixed_pipeline": (">=", 1.3),
    "auto_vs_best": (">=", 0.95),
    "cost_model_error": ("<=", 0.10),
    "idle_vs_centralized": ("<=", 0.5),
    "off_policy_vs_on_policy": (">=", 1.3),
    "off_policy_auto_vs_on_policy": (">=", 1.3),
    "off_policy_fixed_vs_fixed_pipeline": (">=", 1.3),
    "off_policy_partial_vs_on_policy": (">=", 1.3),
    "stale_best_vs_centralized": (">=", 1.5),
    "stale_idle_vs_centralized": ("<=", 0.5),
}
MODES = (
    "centralized", "fixed_pipeline", "disaggregated", "collocated", "hybrid", "auto", "off_policy",
    "off_policy_auto", "off_policy_fixed", "fixed_engine", "partial", "off_policy_partial",
)  # fmt: skip
OURS = ("disaggregated", "collocated", "hybrid")
#: Modes whose trained samples are partly older than the last update (staleness bounded and
#: recorded as ``policy_lag``): judged apart from the on-policy ones.
STALE = ("partial", "off_policy_partial")
#: Partial rollouts in the ``partial`` modes: an engine stops when 20% of its step's requests
#: still decode and goes on with them in its next step; a response spans at most 3 steps.
PARTIAL = ["emulation.partial_rollouts=0.2", "emulation.partial_rollout_steps=3"]


def work_split(
    profile: Profile,
    workers: int,
    micro_batch: int,
    names: list[str] | None = None,
    engine: bool = True,
    partial: bool = False,
) -> dict[str, int]:
    """Ranks per stage in proportion to each stage's seconds per item (from the profile, at
    ``micro_batch``; a generation engine at two batches of slots, or with ``partial`` rollouts,
    which do not wait for the tail, at its full-occupancy throughput), as a user sizing a
    pipeline by hand would."""
    rng = random.Random(0)
    lengths = profile.lengths(rng, 4096)

    def chunks(name: str) -> list[list[int]]:
        size = 2 * profile.slots if engine and profile.stages[name].kind == "generate" else micro_batch
        return [lengths[i : i + size] for i in range(0, len(lengths), size)]

    def seconds(name: str, chunk: list[int]) -> float:
        if partial and profile.stages[name].kind == "generate":
            return profile.full_occupancy_seconds(sum(chunk)) + profile.stages[name].seconds_per_call
        return profile.stage_seconds(name, chunk)

    names = names or list(profile.stages)
    costs = []
    for name in names:
        parts = name.split("+")
        per_item = sum(seconds(p, c) for p in parts for c in chunks(p)) / len(lengths)
        # a trainer's update over the step's samples (its finish) is work per item too
        per_item += sum(profile.stages[p].finish_per_sample for p in parts)
        costs.append(PhaseProfile(name, per_item))
    return split_ranks(costs, workers)


def hybrid_pair(profile: Profile) -> tuple[str, str]:
    """The two stages hybrid puts on shared ranks: the model stages a step runs first (rollout
    and inference of an LLM step; policy and actor of an embodied one), else the first two on a
    device."""
    stages = list(profile.stages)
    for pair in (("rollout", "inference"), ("policy", "actor")):
        if all(s in stages for s in pair):
            return pair
    on_device = [s for s in stages if profile.stages[s].on_device] + stages
    return on_device[0], next(s for s in on_device if s != on_device[0])


def generation_group(profile: Profile) -> tuple[str, ...]:
    """The stages the stale modes put on shared ranks: every stage before the trainers (the
    profile's ``train_stages``), so that a CPU stage between them (the reward) runs on the
    generation ranks instead of holding a device of its own; with only one stage before the
    trainers, `hybrid_pair`."""
    before = profile.generation_stages
    return before if len(before) > 1 else hybrid_pair(profile)


def mode_settings(mode: str, profile: Profile, workers: int, samples: int, micro_batch: int) -> list[str]:
    stages = list(profile.stages)
    elastic = [
        f"pipeline.micro_batch={micro_batch}",
        "pipeline.min_micro_batch=4",
        "pipeline.max_micro_batch=512",
    ]
    every = [f"components.{s}.num_ranks={workers}" for s in stages]
    if mode == "centralized":
        whole = [f"pipeline.{k}={samples}" for k in ("micro_batch", "min_micro_batch", "max_micro_batch")]
        return [
            "placement.mode=collocated",
            "pipeline.elastic=false",
            "pipeline.balance=round_robin",
            *whole,
            *every,
        ]
    if mode in ("fixed_pipeline", "disaggregated", "off_policy", "off_policy_fixed", "fixed_engine"):
        engine = mode not in ("fixed_pipeline", "off_policy_fixed")
        split = work_split(profile, workers, micro_batch, engine=engine)
        sets = ["placement.mode=disaggregated", *[f"components.{s}.num_ranks={n}" for s, n in split.items()]]
        if not engine:
            sets.append("emulation.continuous_generation=false")
        if mode == "off_policy":
            return [*sets, *elastic, "emulation.off_policy_steps=1"]
        if mode == "off_policy_fixed":
            sets.append("emulation.off_policy_steps=1")
        if mode in ("fixed_pipeline", "off_policy_fixed", "fixed_engine"):
            fixed = [
                f"pipeline.{k}={micro_batch}" for k in ("micro_batch", "min_micro_batch", "max_micro_batch")
            ]
            return [*sets, "pipeline.elastic=false", *fixed]
        return [*sets, *elastic]
    if mode == "collocated":
        return ["placement.mode=collocated", *every, *elastic]
    off = ["emulation.off_policy_steps=1"] if mode == "off_policy_partial" else []
    if mode in ("hybrid", *STALE):  # shared ranks (see hybrid_pair, generation_group), the rest apart
        shared = generation_group(profile) if mode in STALE else hybrid_pair(profile)
        others = [s for s in stages if s not in shared]
        split = work_split(profile, workers, micro_batch, ["+".join(shared), *others], partial=mode in STALE)
        sets = [f"components.{s}.num_ranks={split['+'.join(shared)]}" for s in shared]
        sets += [f"components.{s}.num_ranks={split[s]}" for s in others]
        groups = "[[" + ", ".join(f'"{s}"' for s in shared) + "]]"
        stale = [*PARTIAL, *off] if mode in STALE else []  # partial rollouts (and off-policy)
        return ["placement.mode=hybrid", f"placement.groups={groups}", *sets, *elastic, *stale]
    # the default warm-up (2 steps): the first step of a job is slower than the rest (20% here),
    # and an engine's fitted model from it mispredicts more than its mean seconds per item
    off = ["emulation.off_policy_steps=1"] if mode == "off_policy_auto" else []
    return ["placement.mode=auto", *every, *elastic, *off]


def config_text(profile: Profile, spec: str, time_scale: float, steps: int) -> str:
    """The job's config for ``profile`` (``spec``: its built-in name or its file's path)."""
    where = Path(spec).resolve() if spec.endswith(".toml") else spec
    components = "".join(
        f'[components.{name}]\nworker = "rlinf_hpc.apps.emulated.workers:EmulatedStage"\n\n'
        for name in profile.stages
    )
    return (
        f'[job]\nname = "emulated-{profile.name}"\nnum_ranks = 8\ncall_timeout_s = 300\n\n{components}'
        '[placement]\nmode = "disaggregated"\nswitch = "full"\n\n'
        "[pipeline]\ncapacity = 4096\n\n"
        f'[emulation]\nprofile = "{where}"\ntime_scale = {time_scale}\nsteps = {steps}\n\n'
        '[flow]\nrunner = "emulated_rl"\n'
    )


def auto_warmup(sets: list[str]) -> int:
    """`placement.auto_warmup_steps` as the job sees it: the last ``--set`` of it, else the default.

    >>> auto_warmup(["placement.mode=auto"]), auto_warmup(["placement.auto_warmup_steps=4"])
    (2, 4)
    """
    from rlinf_hpc.config.scheduling import PlacementConfig

    given = [s.split("=", 1)[1] for s in sets if s.startswith("placement.auto_warmup_steps=")]
    return int(given[-1]) if given else PlacementConfig.model_fields["auto_warmup_steps"].default


def run_mode(config: Path, out: Path, mode: str, ranks: int, sets: list[str]) -> dict[str, Any]:
    run_dir = out / f"{config.stem}-{mode}-{ranks}"
    command = [
        str(Path(sys.executable).parent / "rlinf-hpc"), "run", str(config), "--np", str(ranks),
        "--run-dir", str(run_dir), "--resume", "never", "--set", "checkpoint.enabled=false",
    ]  # fmt: skip
    for item in sets:
        command += ["--set", item]
    started = time.monotonic()
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900
    )
    if run_dir.is_dir():  # the job's own log, for reading a run afterwards
        (run_dir / "job.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(
            f"{mode} at {ranks} ranks failed (exit {done.returncode}):\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # auto: its warm-up and first decided step
    skip = auto_warmup(sets) + 1 if mode in ("auto", "off_policy_auto") else 2
    # not the last step either: off-policy's last step only trains (nothing left to generate)
    measured = records[skip:-1] or records[-1:]

    def mean(key: str) -> float:
        return sum(r[key] for r in measured) / len(measured)

    predicted = [r["predicted_step_s"] for r in measured if "predicted_step_s" in r]
    return {
        "step_s": mean("step_s"),
        # between the steps' records: also the flow's bookkeeping
        "wall_step_s": mean("wall_s"),
        "idle_fraction": mean("idle_fraction"),
        "coordinator_busy_fraction": mean("coordinator_busy_fraction"),
        "predicted_step_s": sum(predicted) / len(predicted) if predicted else None,
        "tokens_per_s": mean("tokens_per_s"),
        "on_policy_floor_s": mean("on_policy_floor_s"),
        # of the steps measured: off-policy's last step only trains (its micro-batches are the
        # trainer's alone), and auto may move after them
        "placement": measured[-1]["placement"],
        "micro_batch": measured[-1]["micro_batch"],
        # staleness: the most updates between a trained token's generation and its update
        "policy_lag": max(r.get("policy_lag", 0) for r in records),
        "carried_fraction": sum(
            r.get("partial_carried", 0) / max(1, r.get("samples_trained", 1)) for r in measured
        )
        / len(measured),
        "job_s": time.monotonic() - started,
    }


def plot(raw: dict[str, dict[str, dict[str, Any]]], profile: str, path: Path) -> None:
    curves = {}
    for mode in MODES:
        points = sorted((int(r), v[mode]["step_s"]) for r, v in raw[profile].items() if mode in v)
        if points:
            curves[mode] = ([p[0] for p in points], [p[1] for p in points])
    panel = ("ranks (coordinator + emulated devices)", "step time (s, emulated at time scale)", curves)
    plot_curves(path, f"EMULATION: {profile} step time vs ranks", [panel], log2_x=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="write {'ratios': ..., 'raw': ...} here")
    parser.add_argument("--png", help="step time vs ranks (default: bench_scale.png in the output dir)")
    parser.add_argument("--out", help="run directories (default: a temporary directory)")
    parser.add_argument("--ranks", default="8,16,32", help="rank counts for --profile")
    parser.add_argument(
        "--profile", default="grpo-7b",
        help=f"a built-in profile ({', '.join(PROFILES)}) or a .toml profile file of your own "
        "(rlinf_hpc/apps/emulated/profile_file.py)",
    )  # fmt: skip
    parser.add_argument(
        "--others",
        default="grpo-1.5b,grpo-32b,embodied",
        help="profiles (names or files) run at --others-ranks",
    )
    parser.add_argument("--others-ranks", type=int, default=16)
    parser.add_argument("--others-modes", default="centralized,fixed_pipeline,disaggregated,collocated")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--time-scale", type=float, default=0.01)
    parser.add_argument("--modes", default=",".join(m for m in MODES if m != "partial"))
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override (all modes)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke size: bounds reported, not enforced")
    args = parser.parse_args()
    ranks = sorted(int(r) for r in args.ranks.split(","))
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown or args.steps < 4:
        parser.error(f"unknown modes {sorted(unknown)}" if unknown else "--steps must be >= 4")
    from rlinf_hpc.runtime.console import print_table

    specs = [args.profile] + [p for p in args.others.split(",") if p and p != args.profile]
    try:  # a profile file is checked before anything runs
        profiles = {spec: get_profile(spec) for spec in specs}
    except ProfileError as exc:
        parser.error(str(exc))
    main_name = profiles[args.profile].name
    if len({p.name for p in profiles.values()}) < len(profiles):
        parser.error(f"two profiles are named alike: {sorted(p.name for p in profiles.values())}")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-scale-"))
    out.mkdir(parents=True, exist_ok=True)
    plan = [(args.profile, r) for r in ranks] + [(p, args.others_ranks) for p in specs[1:]]
    raw: dict[str, dict[str, dict[str, Any]]] = {}
    for spec, count in plan:
        profile = profiles[spec]
        name = profile.name
        config = out / f"{name}.toml"
        config.write_text(config_text(profile, spec, args.time_scale, args.steps))
        workers = count - 1
        for mode in modes if name == main_name else [m for m in args.others_modes.split(",") if m]:
            sets = [
                *args.set,
                *mode_settings(mode, profile, workers, profile.samples_per_step, args.micro_batch),
            ]
            print(f"EMULATION {name} {mode} at {count} ranks ...", flush=True)
            raw.setdefault(name, {}).setdefault(str(count), {})[mode] = run_mode(
                config, out, mode, count, sets
            )
    rows = []
    for name, by_ranks in raw.items():
        for count, by_mode in by_ranks.items():
            for mode, r in by_mode.items():
                predicted = "-" if r["predicted_step_s"] is None else f"{r['predicted_step_s']:.3f}"
                rows.append(
                    (name, count, mode, r["placement"], f"{r['step_s']:.3f}",
                     f"{r['wall_step_s']:.3f}", predicted, f"{100 * r['idle_fraction']:.0f}%",
                     f"{100 * r['coordinator_busy_fraction']:.1f}%",
                     str(r.get("policy_lag", 0)),
                     " ".join(f"{k}:{v:g}" for k, v in r["micro_batch"].items()))
                )  # fmt: skip
    print_table(
        f"EMULATED accelerators (time scale {args.time_scale}; sleep-costed stages, not real devices)",
        [
            "profile",
            "ranks",
            "mode",
            "placement",
            "step s",
            "wall s",
            "predicted s",
            "idle",
            "coordinator",
            "lag",
            "micro-batch",
        ],
        rows,
    )
    ratios, per_size = compute_ratios(raw[main_name], ranks)
    png = Path(args.png) if args.png else out / "bench_scale.png"
    plot(raw, main_name, png)
    print_table(
        "per rank count (" + main_name + ")",
        ["ranks", "best mode", "best/centralized", "ceiling", "floor s", "best/fixed", "best/fixed+engine",
         "auto/best", "idle best/centralized", "off/on-policy", "off auto/best", "stale best",
         "stale/centralized", "stale idle/centralized"],
        [(k, str(v["best"]), f"{v['best_vs_centralized']:.2f}", f"{v['ceiling']:.2f}", f"{v['floor_s']:.3f}",
          f"{v['best_vs_fixed_pipeline']:.2f}", f"{v['best_vs_fixed_engine']:.2f}",
          f"{v['auto_vs_best']:.2f}", f"{v['idle_vs_centralized']:.2f}",
          f"{v['off_policy_vs_on_policy']:.2f}", f"{v['off_policy_auto_vs_on_policy']:.2f}",
          str(v["stale_best"]),
          f"{v['stale_best_vs_centralized']:.2f}", f"{v['stale_idle_vs_centralized']:.2f}")
         for k, v in per_size.items()],
    )  # fmt: skip
    rows, ok = check_ratios(
        ratios, {k: REQUIRED[k] for k in ratios}, not_yet_met=set(REQUIRED) if args.quick else ()
    )
    print_table("ratios (EMULATION)", ["ratio", "value", "required", "status"], rows)
    print(f"curves: {png}")
    write_json(args.json, {"ratios": ratios, "raw": raw, "per_rank_count": per_size, "png": str(png),
                           "emulated": True, "time_scale": args.time_scale, "quick": args.quick})  # fmt: skip
    return 0 if ok else 1


def ceiling(modes: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The on-policy floor (s) of the run's steps and the most ``best_vs_centralized`` can be:
    centralized's step over the larger of the floor and centralized's work spread over its
    ranks with no idle time (see the module's docstring).

    >>> ceiling({"centralized": {"step_s": 2.0, "idle_fraction": 0.5, "on_policy_floor_s": 0.8}})
    {'floor_s': 0.8, 'ceiling': 2.0}
    >>> ceiling({"centralized": {"step_s": 2.0, "idle_fraction": 0.5, "on_policy_floor_s": 1.6}})
    {'floor_s': 1.6, 'ceiling': 1.25}
    """
    if "centralized" not in modes:
        return {"floor_s": math.nan, "ceiling": math.nan}
    central = modes["centralized"]
    work = central["step_s"] * (1 - central["idle_fraction"])  # no idle time at all
    floor = central.get("on_policy_floor_s", 0.0)  # the same responses in every on-policy mode
    return {"floor_s": floor, "ceiling": central["step_s"] / max(1e-9, work, floor)}


def compute_ratios(
    by_ranks: dict[str, dict[str, Any]], ranks: list[int]
) -> tuple[dict[str, float], dict[str, Any]]:
    """The ratios at the middle and largest rank counts (the worse of the two for each), and
    the cost model's largest error over every mode and rank count."""
    per_size: dict[str, Any] = {}
    for count in [str(r) for r in ranks]:
        modes = by_ranks[count]
        manual = {m: modes[m]["step_s"] for m in OURS if m in modes}
        best_manual = min(manual, key=manual.__getitem__) if manual else None
        ours = {m: modes[m]["step_s"] for m in (*OURS, "auto") if m in modes}  # every on-policy M2Flow mode
        best = min(ours, key=ours.__getitem__) if ours else None
        stale = {m: modes[m]["step_s"] for m in STALE if m in modes}
        stale_best = min(stale, key=stale.__getitem__) if stale else None

        def ratio(a: str | None, b: str | None, key: str = "step_s", modes: dict = modes) -> float:
            if a is None or b is None or a not in modes or b not in modes:
                return math.nan
            return modes[a][key] / max(modes[b][key], 1e-9)

        per_size[count] = {
            "best": best,
            "best_vs_centralized": ratio("centralized", best),
            "best_vs_fixed_pipeline": ratio("fixed_pipeline", best),
            "best_manual": best_manual,
            "auto_vs_best": ratio(best_manual, "auto"),
            "idle_vs_centralized": ratio(best, "centralized", "idle_fraction"),
            "off_policy_vs_on_policy": ratio("disaggregated", "off_policy"),
            "off_policy_auto_vs_on_policy": ratio(best, "off_policy_auto"),
            "off_policy_fixed_vs_fixed_pipeline": ratio("fixed_pipeline", "off_policy_fixed"),
            "best_vs_fixed_engine": ratio("fixed_engine", best),
            "off_policy_partial_vs_on_policy": ratio(best, "off_policy_partial"),
            "stale_best": stale_best,
            "stale_best_vs_centralized": ratio("centralized", stale_best),
            "stale_idle_vs_centralized": ratio(stale_best, "centralized", "idle_fraction"),
            **ceiling(modes),
        }
    judged = [per_size[str(r)] for r in ranks[-2:] if str(r) in per_size] or list(per_size.values())
    ratios = {}
    for key in (
        "best_vs_centralized", "best_vs_fixed_pipeline", "auto_vs_best", "off_policy_vs_on_policy",
        "off_policy_auto_vs_on_policy", "off_policy_fixed_vs_fixed_pipeline",
        "off_policy_partial_vs_on_policy", "stale_best_vs_centralized",
    ):  # fmt: skip
        values = [e[key] for e in judged if not math.isnan(e[key])]
        if values:
            ratios[key] = min(values)  # the worse of the two rank counts
    for key in ("idle_vs_centralized", "stale_idle_vs_centralized"):
        values = [e[key] for e in judged if not math.isnan(e[key])]
        if values:
            ratios[key] = max(values)
    errors = [
        abs(r["predicted_step_s"] - r["step_s"]) / r["step_s"]
        for modes in by_ranks.values() for r in modes.values() if r["predicted_step_s"]
    ]  # fmt: skip
    if errors:
        ratios["cost_model_error"] = max(errors)
    return ratios, per_size


if __name__ == "__main__":
    sys.exit(main())
