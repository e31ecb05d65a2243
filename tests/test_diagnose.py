"""`rlinf-hpc diagnose`: env (versions, variables, NVML health through the fake NVML), comm (the
full latency/bandwidth matrix and the all-reduce check among 4 ranks; a failing link is named),
memory (a leak's rate and allocation site, a healthy function's none, a worker method)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from rlinf_hpc.comm.linkcheck import check_links
from rlinf_hpc.errors import CommTimeoutError

from conftest import job_env, rlinf

FAKE_NVML = Path(__file__).parent / "fake_nvml"
LEAKY = """
KEPT = []


def leak(mb=1.0):
    KEPT.append(bytearray(int(mb * 2**20)))


def healthy():
    return [bytearray(2**20) for _ in range(4)]
"""


def test_env_reports_versions_variables_and_gpu_health(tmp_path: Path) -> None:
    out = rlinf("diagnose", "env", "--json", str(tmp_path / "env.json"))
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "env.json").read_text())
    assert report["torch"].startswith("2.") and "MPICH" in report["mpi_library"]
    assert report["variables"]["OMP_NUM_THREADS"] == "1"
    assert report["gpus"] == [] and report["nvml"].startswith("off")
    assert "GPUs: none" in out.stdout

    scenario = tmp_path / "nvml.json"  # one GPU at 91 °C, throttled, a pending row remapping
    scenario.write_text(json.dumps({"gpus": 1, "changes": [[0, {"temp_c": 91, "throttle": 64,
                                                                 "remapped": [0, 0, 1, 0]}]]}))  # fmt: skip
    env = job_env({"FAKE_NVML_SCENARIO": str(scenario)})
    env["PYTHONPATH"] = os.pathsep.join([str(FAKE_NVML), env["PYTHONPATH"]])
    out = rlinf("diagnose", "env", "--json", str(tmp_path / "gpu.json"), env=env)
    assert out.returncode == 0, out.stderr
    gpu = json.loads((tmp_path / "gpu.json").read_text())["gpus"][0]
    assert gpu["name"] == "Fake GPU" and gpu["temp_c"] == 91
    assert any("91 °C" in a for a in gpu["alarms"]) and any(
        "row remapping is pending" in a for a in gpu["alarms"]
    )
    assert "note: GPU 0: GPU 0 clocks throttled: hardware thermal slowdown" in out.stdout


@pytest.mark.mpi
def test_comm_on_four_ranks_yields_the_full_matrix_and_a_correct_all_reduce(tmp_path: Path) -> None:
    out = rlinf("diagnose", "comm", "--np", "4", "--size-mb", "4", "--iters", "3", "--out", str(tmp_path),
                timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "diagnose_comm.json").read_text())
    assert report["backend"] == "mpi" and len(report["hosts"]) == 4
    for key in ("bandwidth_gbs", "latency_us"):
        cells = [(i, j, v) for i, row in enumerate(report[key]) for j, v in enumerate(row)]
        assert all((v is None) == (i == j) for i, j, v in cells), report[key]
        assert all(v > 0 for i, j, v in cells if i != j)
    assert report["allreduce"]["ok"] and report["allreduce"]["busbw_gbs"] == pytest.approx(
        report["allreduce"]["algbw_gbs"] * 1.5
    )
    assert (tmp_path / "comm_heatmap.png").stat().st_size > 1000
    assert "all-reduce 4 MB on 4 ranks: sum correct" in out.stdout


@pytest.mark.mpi
def test_comm_over_gloo(tmp_path: Path) -> None:
    out = rlinf("diagnose", "comm", "--np", "2", "--backend", "gloo", "--size-mb", "1",
                "--out", str(tmp_path), timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "diagnose_comm.json").read_text())
    assert report["backend"] == "gloo" and report["bandwidth_gbs"][0][1] > 0 and report["allreduce"]["ok"]


class _TwoRankComm:
    """Rank 0's view of a two-rank world whose rank 1 measured nothing."""

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
        return 0

    def Get_size(self) -> int:  # noqa: N802
        return 2

    def allgather(self, value: Any) -> list[Any]:
        return [value, "peer-host"]

    def gather(self, value: Any, root: int = 0) -> list[Any]:
        return [value, ([None, None], [None, None], [])]


class _DeadLinkTransport:
    name = "mpi"

    def buffer(self, nbytes: int, fill: float = 1.0) -> list[float]:
        return [fill]

    def send(self, buf: Any, peer: int) -> None:
        raise CommTimeoutError(f"send to rank {peer}: not done after 1 s")

    recv = send

    def barrier(self) -> None:
        pass

    def all_reduce(self, buf: list[float]) -> list[float]:
        return [buf[0] + 2.0]  # rank 1 contributes 2

    def total(self, buf: list[float]) -> float:
        return buf[0]


def test_a_link_that_does_not_answer_is_flagged_failing() -> None:
    report = check_links(_TwoRankComm(), _DeadLinkTransport(), size=8, iters=1, latency_iters=1)
    assert report is not None
    assert report.flags == [
        {"src": 0, "dst": 1, "kind": "failing", "what": "send to rank 1: not done after 1 s"}
    ]
    assert report.allreduce["ok"] and report.bandwidth_gbs == [[None, None], [None, None]]


def test_memory_names_a_leaks_rate_and_site(tmp_path: Path) -> None:
    (tmp_path / "leaky_mod.py").write_text(LEAKY)
    env = job_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    out = rlinf("diagnose", "memory", "leaky_mod:leak", "--kwargs", '{"mb": 2}', "--iterations", "8",
                "--json", str(tmp_path / "leak.json"), env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "leak.json").read_text())
    assert report["rss_mb_per_iter"] == pytest.approx(2.0, rel=0.2)
    assert report["python_kb_per_iter"] == pytest.approx(2048, rel=0.05)
    assert report["top_sites"][0]["site"] == f"{tmp_path / 'leaky_mod.py'}:6"
    assert report["top_sites"][0]["kb_per_iter"] == pytest.approx(2048, rel=0.05)

    out = rlinf("diagnose", "memory", "leaky_mod:healthy", "--iterations", "8", "--json",
                str(tmp_path / "healthy.json"), env=env)  # fmt: skip
    healthy = json.loads((tmp_path / "healthy.json").read_text())
    assert abs(healthy["rss_mb_per_iter"]) < 0.5 and abs(healthy["python_kb_per_iter"]) < 64, healthy


def test_memory_of_a_worker_method() -> None:
    out = rlinf("diagnose", "memory", "job_workers:LeakyWorker.leak", "--options", '{"leak_mb": 1}',
                "--kwargs", '{"batch": [1]}', "--iterations", "4", "--warmup", "1")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "job_workers.py" in out.stdout and "1024.0" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no_such_module_xyz:f"], "cannot import module 'no_such_module_xyz'"),
        (["job_workers:ProbeWorker.nothing"], "has no method 'nothing'"),
        (["job_workers:probe_toml_missing"], "is missing"),
        (["json:dumps", "--kwargs", "[1]"], "--kwargs must be a JSON object"),
        (["json:dumps", "--iterations", "2"], "--iterations must be >= 3"),
    ],
)
def test_memory_bad_input_is_one_paragraph_and_exit_2(args: list[str], message: str) -> None:
    out = rlinf("diagnose", "memory", *args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr


def test_comm_refuses_a_single_rank() -> None:
    out = rlinf("diagnose", "comm", "--np", "1")
    assert out.returncode == 2 and "at least 2 ranks" in out.stderr
