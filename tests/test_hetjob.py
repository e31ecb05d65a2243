"""Heterogeneous SLURM jobs: the layout read from the allocation, components placed on their
part (simulators on the CPU part with rank 0, policy and actor on the GPU part), the embodied
job with that placement on CPU ranks, and the sbatch template — checked by `sbatch --test-only`
and run for real as a two-part job on the local cluster's partition `het` (two slurmd on this
machine: on its one-node default partition SLURM 22.05's backfill planned the second part only
after the first had ended, so a submitted hetjob stayed pending)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_slurm import _REASON as SLURM_MISSING
from test_slurm import _gone_within, sbatch_wait

from rlinf_hpc.cluster import GpuProbe, RankInfo, build_topology
from rlinf_hpc.cluster.hetjob import read_het_layout
from rlinf_hpc.config import Config
from rlinf_hpc.errors import UserError
from rlinf_hpc.scheduler import plan_placement

from conftest import REPO, job_env, rlinf, run_command

TEMPLATE = REPO / "slurm" / "hetjob_embodied.sbatch"
CONFIG = REPO / "configs" / "embodied_ppo_hetjob.toml"


def het_slots(sizes: tuple[int, ...], gpu_part: int | None = 1) -> list:
    """Ranks of a hetjob: part p's ranks on host ``part-p``, GPUs only on ``gpu_part``."""
    layout = read_het_layout({"RLINF_HPC_HET_TASKS": ",".join(map(str, sizes))})
    assert layout is not None
    infos = []
    for rank in range(layout.total):
        part = layout.group_of(rank)
        gpus = 2 if part == gpu_part else 0
        probe = GpuProbe(gpus, ["H200"] * gpus, "ok" if gpus else "off")
        infos.append(RankInfo(rank, f"part-{part}", 1000 + rank, None, (0,), probe, het_group=part))
    return build_topology(infos)


def config(placement: dict | None = None, **components: dict) -> Config:
    spec = {name: {"worker": "m:C", **c} for name, c in components.items()}
    return Config.model_validate({"components": spec, "placement": placement or {}})


EMBODIED = {
    "env": {"num_ranks": 2, "het_group": 0, "device": "cpu"},
    "policy": {"num_ranks": 1, "het_group": 1, "device": "gpu"},
    "actor": {"num_ranks": 1, "het_group": 1, "device": "gpu"},
}


def test_components_go_to_their_part_of_the_allocation() -> None:
    slots = het_slots((3, 2))
    assert [(s.rank, s.het_group, s.device) for s in slots] == [
        (0, 0, "cpu"), (1, 0, "cpu"), (2, 0, "cpu"), (3, 1, "cuda:0"), (4, 1, "cuda:1")]  # fmt: skip
    placement = plan_placement(config(**EMBODIED), slots)
    assert placement.groups == {"env": [1, 2], "policy": [3], "actor": [4]}
    hybrid = {"mode": "hybrid", "groups": [["policy", "actor"]]}
    shared = dict(
        EMBODIED, policy={**EMBODIED["policy"], "num_ranks": 2}, actor={**EMBODIED["actor"], "num_ranks": 2}
    )
    assert plan_placement(config(hybrid, **shared), slots).groups == {
        "env": [1, 2],
        "policy": [3, 4],
        "actor": [3, 4],
    }
    # without het_group, config order would have put env on the first free ranks anyway; with it, a
    # config that lists the GPU components first still keeps env off the GPU part
    reordered = {"policy": EMBODIED["policy"], "actor": EMBODIED["actor"], "env": EMBODIED["env"]}
    assert plan_placement(config(**reordered), slots).groups == {"policy": [3], "actor": [4], "env": [1, 2]}


@pytest.mark.parametrize(
    ("placement", "components", "sizes", "message"),
    [
        (None, EMBODIED, None, "is not a heterogeneous SLURM job"),
        (
            None,
            dict(EMBODIED, env={**EMBODIED["env"], "num_ranks": 3}),
            (3, 2),
            "in component 0 of the heterogeneous job",
        ),
        (None, dict(EMBODIED, env={"het_group": 2}), (3, 2), "has worker ranks only in component"),
        ({"mode": "hybrid", "groups": [["env", "policy"]]}, EMBODIED, (3, 2), "ask for different components"),
        ({"mode": "auto"}, EMBODIED, (3, 2), "choose disaggregated, collocated or hybrid"),
    ],
)
def test_placements_a_hetjob_cannot_give_are_refused(placement, components, sizes, message) -> None:  # noqa: ANN001
    slots = (
        het_slots(sizes)
        if sizes
        else build_topology([RankInfo(r, "h", r, None, (0,), GpuProbe(2)) for r in range(5)])
    )
    with pytest.raises(UserError, match=message):
        plan_placement(config(placement, **components), slots)


def test_a_malformed_layout_variable_is_a_user_error() -> None:
    with pytest.raises(UserError, match="is not a list of task counts"):
        read_het_layout({"RLINF_HPC_HET_TASKS": "3,x"})


@pytest.mark.mpi
def test_the_hetjob_placement_runs_on_cpu_ranks(tmp_path: Path) -> None:
    """The template's placement under mpiexec: parts of 3 and 2 ranks from RLINF_HPC_HET_TASKS."""
    run_dir = tmp_path / "run"
    env = job_env({"RLINF_HPC_HET_TASKS": "3,2"})
    sets = ["components.policy.device=any", "components.actor.device=any", "ppo.iterations=2",
            "env.envs_per_rank=4", "ppo.rollout_steps=16", "ppo.minibatches=2"]  # fmt: skip
    result = rlinf("run", str(CONFIG), "--run-dir", str(run_dir), *[f"--set={s}" for s in sets], env=env,
                   timeout=240)  # fmt: skip
    assert result.returncode == 0, result.output
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    placement = next(e for e in events if e["event"] == "placement")
    assert placement["groups"] == {"env": [1, 2], "policy": [3], "actor": [4]}, placement
    assert json.loads((run_dir / "summary.json").read_text())["outcome"] == "ok"


def test_the_template_refuses_to_run_outside_a_hetjob() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(["bash", str(TEMPLATE)], capture_output=True, text=True, env=env, timeout=30)
    assert done.returncode == 2 and "not a heterogeneous job" in done.stderr


def _cpu_template(tmp_path: Path, nodes: tuple[str, str] | None = None) -> Path:
    """The template for the local cluster: the GPUs and the cores per task taken out (its nodes
    have no GPUs); with ``nodes``, each part on a node of partition ``het``."""
    text = TEMPLATE.read_text().replace("#SBATCH --gpus-per-task=1\n", "")
    for cores, node in zip(("4", "8"), nodes or ("", ""), strict=True):
        where = f"#SBATCH --partition=het\n#SBATCH --nodelist={node}\n" if node else ""
        text = text.replace(f"#SBATCH --cpus-per-task={cores}\n", f"#SBATCH --cpus-per-task=1\n{where}")
    script = tmp_path / "cpu.sbatch"
    script.write_text(text)
    return script


@pytest.mark.slurm
@pytest.mark.skipif(SLURM_MISSING is not None, reason=str(SLURM_MISSING))
def test_the_template_is_a_valid_two_part_job_for_sbatch(tmp_path: Path) -> None:
    """`sbatch --test-only` on the local cluster's default partition: the two parts parse and fit."""
    script = _cpu_template(tmp_path)
    sbatch = shutil.which("sbatch") or "sbatch"
    done = subprocess.run([sbatch, "--test-only", str(script)], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env=job_env())  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "using 5 processors" in done.stderr, done.stderr  # 3 + 2 tasks


#: What slurmstepd logs when Slurm's pmi2 plugin cut a PMI-1 request over 1024 bytes (the UCX
#: business card's lines across nodes; rlinf_hpc.comm.mpi gives such steps OFI instead): a job of
#: ours must never show it.
PMI2_CUT = "mpi/pmi2: value not properly terminated in client request"


def _het_partition_missing() -> str | None:
    if SLURM_MISSING is not None:
        return str(SLURM_MISSING)
    sinfo = ["sinfo", "-h", "-p", "het", "-o", "%N"]
    shown = subprocess.run(sinfo, capture_output=True, text=True, timeout=30, env=job_env())
    if "het-cpu" not in shown.stdout or "het-gpu" not in shown.stdout:
        return "the local cluster has no partition `het` (an older slurm/local/up.sh, or RLINF_SLURM_HET=0)"
    return None


@pytest.mark.slurm
@pytest.mark.skipif(_het_partition_missing() is not None, reason=str(_het_partition_missing()))
def test_the_template_runs_as_a_heterogeneous_job_on_the_local_cluster(tmp_path: Path) -> None:
    """The real thing: `sbatch` of the template, its two parts on two SLURM nodes (partition `het`
    of slurm/local/up.sh: two slurmd on this machine), one MPI world over both through
    `srun --het-group=0,1 --mpi=pmi2`, and the embodied job placed from the allocation."""
    script = _cpu_template(tmp_path, ("het-cpu", "het-gpu"))
    run_dir = tmp_path / "run"
    sets = ["components.policy.device=any", "components.actor.device=any", "ppo.iterations=2",
            "env.envs_per_rank=4", "ppo.rollout_steps=16", "ppo.minibatches=2"]  # fmt: skip
    result, text = sbatch_wait(tmp_path, str(script), str(CONFIG), "--run-dir", str(run_dir),
                               *[f"--set={s}" for s in sets], timeout=240)  # fmt: skip
    assert result.returncode == 0, result.output + text
    assert PMI2_CUT not in text, text
    assert "MPI over OFI (MPIR_CVAR_CH4_NETMOD=ofi)" in text, text  # two nodes under Slurm's pmi2
    assert "heterogeneous, part 0 3 task(s) on het-cpu, part 1 2 task(s) on het-gpu" in text, text
    assert "(5 tasks on 2 node(s))" in text, text
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    placement = next(e for e in events if e["event"] == "placement")
    assert placement["groups"] == {"env": [1, 2], "policy": [3], "actor": [4]}, placement
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "ok" and summary["iterations"] == 2, summary


@pytest.mark.slurm
@pytest.mark.skipif(_het_partition_missing() is not None, reason=str(_het_partition_missing()))
def test_a_rank_killed_in_the_second_part_is_named_and_the_job_ends(tmp_path: Path) -> None:
    """kill -9 of the policy rank (part 1, on het-gpu) of a running hetjob: the run names it,
    and the whole job (both parts) leaves the queue within the finalize bound."""
    script = _cpu_template(tmp_path, ("het-cpu", "het-gpu"))
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    sets = ["components.policy.device=any", "components.actor.device=any", "ppo.iterations=1000"]
    submit = run_command(["sbatch", "--parsable", f"--output={out}", f"--chdir={tmp_path}", str(script),
                          str(CONFIG), "--run-dir", str(run_dir), *[f"--set={s}" for s in sets]],
                         timeout=30)  # fmt: skip
    assert submit.returncode == 0, submit.output
    job_id = submit.stdout.strip().split(";")[0]
    beat = run_dir / "heartbeats" / "rank-3.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "iteration 2/" not in (out.read_text() if out.exists() else ""):
        time.sleep(0.2)
    if "iteration 2/" not in (out.read_text() if out.exists() else ""):
        run_command(["scancel", job_id], timeout=30)
        pytest.fail(f"the hetjob did not reach its second iteration in 120 s: {out.read_text()}")
    pid = json.loads(beat.read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    took = _gone_within(job_id, 60)
    assert took < 20, (took, out.read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "rank died", (summary, out.read_text()[-6000:])
    assert summary["culprit"]["rank"] == 3 and summary["culprit"]["component"] == "policy", summary
    assert PMI2_CUT not in out.read_text()
