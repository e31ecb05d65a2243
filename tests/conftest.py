"""Shared helpers: run the CLI (and mpiexec) as a user would, always with a timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent
BIN = Path(sys.executable).parent
CONFIGS = REPO / "configs"

#: A very small model and task: two GRPO steps in seconds.
TINY = [
    "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.intermediate_size=64",
    "task.digits=1", "task.eval_size=16",
    "sft.steps=4", "sft.batch_size=16", "sft.cache_dir=",
    "grpo.steps=2", "grpo.prompts_per_step=8", "grpo.group_size=4", "grpo.eval_every=1",
    "grpo.max_response_length=3",
    "pipeline.micro_batch=2", "pipeline.min_micro_batch=1", "pipeline.max_micro_batch=8",
    "flow.runner=job_workers:GRPO_DIGEST",
]  # fmt: skip

#: Variables with which a developer runs part of an MPI check program by hand; the suite
#: always runs all of it.
SUBSET_VARIABLES = frozenset(
    {"COMM_CHECKS", "CHANNEL_CHECKS", "HARDENING_CHECKS", "STRESS_CHECKS", "GPU_CHECKS", "RING_EXAMPLES"}
)


@dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for child jobs: test workers importable, one thread per rank, no launcher."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "PMI_", "OMPI_", "PMIX_", "MPI_LOCAL", "RLINF_HPC_"))
        and k not in SUBSET_VARIABLES
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    if "SLURM_CONF" in os.environ:
        env["SLURM_CONF"] = os.environ["SLURM_CONF"]
    env.update(extra or {})
    return env


def run_command(
    args: list[str], timeout: float = 120, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Completed:
    """Run a command to completion; a hang fails the test instead of stalling the suite."""
    try:
        proc = subprocess.run(
            args,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env or job_env(),
            cwd=cwd or REPO,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(f"{args} did not finish within {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
    return Completed(proc.returncode, proc.stdout, proc.stderr)


def run_mpi_program(
    num_ranks: int, name: str, timeout: float = 150, extra_env: dict[str, str] | None = None
) -> Completed:
    """``mpiexec -n N python tests/mpi_programs/NAME`` with MPIEXEC_TIMEOUT a little under ours."""
    env = job_env({"MPIEXEC_TIMEOUT": str(int(timeout) - 20), **(extra_env or {})})
    script = TESTS_DIR / "mpi_programs" / name
    return run_command(
        [str(BIN / "mpiexec"), "-n", str(num_ranks), str(BIN / "python"), str(script)], timeout, env
    )


def rlinf(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> Completed:
    """``rlinf-hpc ARGS`` from this venv."""
    return run_command([str(BIN / "rlinf-hpc"), *args], timeout=timeout, env=env)


def mpiexec(num_ranks: int, *args: str, timeout: float = 120, env: dict[str, str] | None = None) -> Completed:
    """``mpiexec -n N rlinf-hpc ARGS`` (ranks run in place, no self-launch)."""
    env = env or job_env()
    env.setdefault("MPIEXEC_TIMEOUT", str(int(timeout)))  # Hydra kills a hung job itself too
    return run_command(
        [str(BIN / "mpiexec"), "-n", str(num_ranks), str(BIN / "rlinf-hpc"), *args],
        timeout=timeout + 10,
        env=env,
    )


@pytest.fixture
def probe_config(tmp_path: Path) -> Path:
    """A config with two components of ProbeWorker (alpha: 1 rank, beta: 1 rank)."""
    path = tmp_path / "probe.toml"
    path.write_text(
        '[job]\nname = "probe"\nnum_ranks = 3\ncall_timeout_s = 60\n'
        '[components.alpha]\nworker = "job_workers:ProbeWorker"\n'
        '[components.beta]\nworker = "job_workers:ProbeWorker"\n'
        '[flow]\nrunner = "job_workers:idle_flow"\n'
    )
    return path


def running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (nobody may reap ranks whose parent died)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def survivors(pids: list[int], grace: float = 5.0) -> list[int]:
    """The pids still running after up to ``grace`` seconds."""
    deadline = time.monotonic() + grace
    while (alive := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def make_tiny_hf_model(path: Path, hidden_size: int = 32, num_heads: int = 2) -> Path:
    """A tiny Qwen2 and a character tokenizer saved as a local Hugging Face directory."""

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rlinf_hpc.apps.math.config import ModelConfig
    from rlinf_hpc.engines.model import tiny_qwen2

    chars = "0123456789+-*=., "
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(chars)}}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=inner, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    spec = type("T", (), {"vocab_size": 64, "bos_id": 1, "eos_id": 2, "pad_id": 0})()
    model = tiny_qwen2(
        ModelConfig(
            hidden_size=hidden_size, num_layers=2, num_heads=num_heads, intermediate_size=2 * hidden_size
        ),
        spec,
        0,
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def probe_toml(tmp_path: Path, flow: str, alpha: int = 1, beta: int = 1, extra: str = "") -> Path:
    """A job of ProbeWorkers (alpha, beta) running ``flow`` from tests/job_workers.py."""
    path = tmp_path / "job.toml"
    path.write_text(
        f'[job]\nname = "probe"\nnum_ranks = {1 + alpha + beta}\ncall_timeout_s = 60\n{extra}\n'
        f'[components.alpha]\nworker = "job_workers:ProbeWorker"\nnum_ranks = {alpha}\n'
        f'options = {{ marker = "A" }}\n'
        f'[components.beta]\nworker = "job_workers:ProbeWorker"\nnum_ranks = {beta}\n'
        f'[flow]\nrunner = "job_workers:{flow}"\n'
    )
    return path


def start_job(args: list[str]) -> subprocess.Popen[str]:
    """Start a job in its own session (a test can signal or kill the whole group)."""
    return subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=job_env({"MPIEXEC_TIMEOUT": "90"}),
        start_new_session=True,
    )


def wait_for_pids(proc: subprocess.Popen[str]) -> tuple[list[int], list[str]]:
    """Read the job's output until its ``PIDS`` line (signal_flow prints it)."""
    lines: list[str] = []
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("PIDS "):
            return [int(p) for p in line.split()[1:]], lines
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail("job never printed its PIDS line:\n" + "".join(lines))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``-n 2 --dist loadgroup``, as the README's test command runs it):
    every test that submits to the local SLURM cluster runs on the same worker, one after
    another (the cluster's 8 CPUs hold one test's jobs, not two), and the tests of a file that
    shares a module- or session-scoped fixture of its own (the checkpoint references) stay on
    one worker, which builds it once; every other test goes wherever a worker is free."""
    for item in items:
        if item.get_closest_marker("slurm") is not None:
            item.add_marker(pytest.mark.xdist_group("slurm"))
            continue
        info = getattr(item, "_fixtureinfo", None)
        shared = [
            d
            for defs in (info.name2fixturedefs.values() if info else ())
            for d in defs
            if d.scope in ("module", "package", "session") and d.baseid  # ours, not pytest's
        ]
        if shared:
            item.add_marker(pytest.mark.xdist_group(item.path.name))
