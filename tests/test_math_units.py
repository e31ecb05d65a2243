"""The math GRPO job's pieces without ranks: task, verifier, tokenizer, GRPO math, generation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from rlinf_hpc.apps.math.config import ModelConfig, TaskConfig
from rlinf_hpc.apps.math.tasks import (
    ArithmeticTask,
    extract_answer,
    load_jsonl_problems,
    make_task,
    score_completion,
)
from rlinf_hpc.config import config_from_dict
from rlinf_hpc.engines.generation import (
    encode_prompts,
    generate,
    sequence_logprobs,
    shared_prefix_logprobs,
)
from rlinf_hpc.engines.model import build_policy, check_model_dir
from rlinf_hpc.engines.tokenizer import CharTokenizer
from rlinf_hpc.errors import UserError

torch.set_num_threads(1)


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("52", "52"),
        ("0052", "52"),
        ("-0", "0"),
        ("+7", "7"),
        ("1,234", "1234"),
        ("12.0", "12"),
        ("The answer is 42.", "42"),
        ("3 apples and 4 pears, so 7", "7"),
        ("#### 18 and then 19", "18"),  # the marked answer wins over a later number
        ("so \\boxed{ -3 } done", "-3"),
        ("12.5", None),  # not an integer
        ("no number here", None),
        ("", None),
    ],
)
def test_extract_answer_on_tricky_completions(text: str, answer: str | None) -> None:
    assert extract_answer(text) == answer


def test_score_rewards_exact_answer_and_format_separately() -> None:
    assert score_completion("52", "52", True, 0.1).reward == pytest.approx(1.1)
    assert score_completion("52", "52", False, 0.1).reward == pytest.approx(1.0)  # right, not ended
    assert score_completion("53", "52", True, 0.1).reward == pytest.approx(0.1)  # well formed only
    wrong = score_completion("5+2", "52", True, 0.1)
    assert (wrong.correct, wrong.well_formed, wrong.reward) == (False, False, 0.0)


def test_arithmetic_task_is_deterministic_and_keeps_eval_held_out() -> None:
    task = ArithmeticTask(digits=2, operations=("+", "-", "*"), terms=3, eval_size=50, seed=3)
    again = ArithmeticTask(digits=2, operations=("+", "-", "*"), terms=3, eval_size=50, seed=3)
    assert task.train_batch(4, 20) == again.train_batch(4, 20)
    assert task.eval_problems() == again.eval_problems()
    held_out = {p.prompt for p in task.eval_problems()}
    assert not held_out & {p.prompt for p in task.train_batch(0, 2000)}
    for problem in task.train_batch(0, 200):  # operator precedence, zero-padded operands
        python = re.sub(r"\d+", lambda m: str(int(m.group())), problem.prompt[:-1])
        assert int(problem.answer) == eval(python)  # noqa: S307
    assert task.train_batch(0, 5) != task.train_batch(0, 5, stream="sft")
    with pytest.raises(UserError, match="task.eval_size = 90 is too large"):
        ArithmeticTask(digits=1, operations=("+",), terms=2, eval_size=90, seed=0)


def test_jsonl_loader_reports_line_numbers(tmp_path: Path) -> None:
    good = tmp_path / "train.jsonl"
    good.write_text(
        json.dumps({"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"})
        + "\n\n"
        + json.dumps({"question": "Big?", "answer": "#### 1,200"})
        + "\n"
    )
    problems = load_jsonl_problems(good, "task.train_path")
    assert [(p.uid, p.answer) for p in problems] == [(0, "7"), (1, "1200")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"question": "q", "answer": "#### 1"}) + "\n" + json.dumps({"question": "q"}) + "\n"
    )
    with pytest.raises(UserError, match=r"bad.jsonl:2: the record has no 'answer' field"):
        load_jsonl_problems(bad, "task.train_path")
    bad.write_text("{not json\n")
    with pytest.raises(UserError, match=r"bad.jsonl:1: not valid JSON"):
        load_jsonl_problems(bad, "task.train_path")
    bad.write_text(json.dumps({"question": "q", "answer": "about seven"}) + "\n")
    with pytest.raises(
        UserError, match=r"bad.jsonl:1: the answer 'about seven' does not end in '#### <number>'"
    ):
        load_jsonl_problems(bad, "task.train_path")
    with pytest.raises(UserError, match="is not a file"):
        load_jsonl_problems(tmp_path / "missing.jsonl", "task.eval_path")
    task = make_task(TaskConfig(kind="jsonl", train_path=str(good), eval_path=str(good)), seed=0)
    assert len(task.train_batch(0, 5)) == 5 and CharTokenizer.for_texts(task.texts()).encode("Tom")


def test_seeded_sampling_does_not_depend_on_the_batch() -> None:
    model, tokenizer = build_policy(
        ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), [], 0
    )
    prompts = encode_prompts(tokenizer, ["12+34=", "56+78=", "90+12="])
    keys = [("s", 0, i) for i in range(3)]
    together = generate(model, tokenizer, prompts, 5, keys, 1.0)
    alone = generate(model, tokenizer, prompts[1:2], 5, keys[1:2], 1.0)
    assert together[1].ids == alone[0].ids
    # rows that repeat a prompt share its prefill; each row still samples what it would alone
    prompts.append(encode_prompts(tokenizer, ["5+6="])[0])  # shorter: left-padded
    rows = [prompts[i] for i in (0, 3, 0, 1, 3, 0)]
    row_keys = [("g", i) for i in range(len(rows))]
    grouped = generate(model, tokenizer, rows, 5, row_keys, 1.0)
    single = [generate(model, tokenizer, [r], 5, [k], 1.0)[0] for r, k in zip(rows, row_keys, strict=True)]
    assert [c.ids for c in grouped] == [c.ids for c in single]
    assert len({tuple(c.ids) for c in grouped}) > 2  # sampled, not one answer copied
    other = generate(model, tokenizer, prompts[:3], 5, [("s", 1, i) for i in range(3)], 1.0)
    assert [c.ids for c in other] != [c.ids for c in together]  # another key, another sample
    # log-probs of a completion equal the sum of the model's next-token log-softmax
    completion = together[0].ids
    (lp,) = sequence_logprobs(model, prompts[:1], [completion], tokenizer.pad_id)
    ids = torch.tensor([prompts[0] + completion])
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=ids).logits[0], dim=-1)
    start = len(prompts[0]) - 1
    manual = [full[start + t, token].item() for t, token in enumerate(completion)]
    assert lp.tolist() == pytest.approx(manual, abs=1e-5)


def test_shared_prefix_logprobs_equal_the_full_rows_and_their_gradients() -> None:
    """GRPO's groups run each prompt once; the completions' log-probs, entropies and the
    gradient of a loss on them are what running every prompt + completion row gives."""
    model, tokenizer = build_policy(
        ModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64), [], 0
    )
    prompts = encode_prompts(tokenizer, ["12+34=", "5+78=", "90+12="])  # 5+78=: left-padded
    rows = [prompts[i] for i in (0, 1, 0, 2, 1, 1, 0)]  # groups interleaved
    completions = [[5 + (3 * i + j) % 7 for j in range(1 + i % 4)] for i in range(len(rows))]
    results, gradients = [], []
    for logprobs in (sequence_logprobs, shared_prefix_logprobs):
        model.zero_grad()
        values, entropies = logprobs(model, rows, completions, tokenizer.pad_id, with_entropy=True)
        (torch.cat(values).sum() + torch.cat(entropies).sum()).backward()
        results.append((values, entropies))
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    for full, shared in zip(*results, strict=True):
        assert [len(t) for t in shared] == [len(c) for c in completions]
        for a, b in zip(full, shared, strict=True):
            assert torch.allclose(a, b, atol=1e-5)
    assert torch.allclose(gradients[0], gradients[1], rtol=1e-4, atol=1e-6)
    assert gradients[0].abs().sum() > 0
    with torch.no_grad():  # every prompt distinct: the plain path
        alone = shared_prefix_logprobs(model, prompts, completions[:3], tokenizer.pad_id)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            alone, sequence_logprobs(model, prompts, completions[:3], tokenizer.pad_id), strict=True
        )
    )


def test_model_directory_checks(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="is not a directory"):
        check_model_dir(str(tmp_path / "nope"))
    with pytest.raises(UserError, match="has no config.json"):
        check_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    with pytest.raises(UserError, match="not a causal language model"):
        check_model_dir(str(tmp_path))


def test_grpo_config_mistakes() -> None:
    base = {
        "components": {"actor": {"worker": "pkg.mod:Cls", "num_ranks": 3}},
        "flow": {"runner": "math_grpo"},
    }
    with pytest.raises(UserError, match="group_size = 1: GRPO normalizes rewards within a group"):
        config_from_dict({**base, "grpo": {"group_size": 1}}, "test")
    with pytest.raises(UserError, match="cannot be split evenly over 3 actor rank"):
        config_from_dict({**base, "grpo": {"prompts_per_step": 32, "group_size": 8}}, "test")
    config_from_dict(
        {**base, "grpo": {"prompts_per_step": 24, "group_size": 8}, "sft": {"batch_size": 240}}, "t"
    )


def test_metrics_log_writes_jsonl_and_flattens_scalars(tmp_path: Path) -> None:
    from rlinf_hpc.runtime.metrics import MetricsLog, _scalars

    record = {"step": 1, "reward": 0.5, "phases_s": {"rollout": 0.2}, "placement": "x", "ok": True}
    assert _scalars(record) == {"step": 1.0, "reward": 0.5, "phases_s/rollout": 0.2}
    log = MetricsLog(tmp_path)
    log.write(1, record)
    log.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == record
    MetricsLog(None).write(1, record)  # no run directory: nothing to write, no error


def test_auto_models_the_update_per_sample_on_accelerators_only() -> None:
    """On CPU ranks that share cores the collocated warm-up's update reads ~3x slow per sample
    (contention, small per-rank batches): the finish stays constant there."""
    from types import SimpleNamespace

    from rlinf_hpc.apps.math.flow import _update_scales

    def job(device: str) -> SimpleNamespace:
        components = {"rollout": SimpleNamespace(device="cpu"), "actor": SimpleNamespace(device=device)}
        return SimpleNamespace(config=SimpleNamespace(components=components))

    assert _update_scales(job("cuda"), "actor") and _update_scales(job("any"), "actor")
    assert not _update_scales(job("cpu"), "actor") and not _update_scales(job("cuda"), "rollout")


@pytest.mark.parametrize("invariant", [True, False])
def test_inference_log_probs_do_not_depend_on_the_micro_batches_around_a_prompt(invariant: bool) -> None:
    """The inference pass of 16 prompts' groups of 4 samples (2-digit sums: prompts of several
    lengths), cut into micro-batches of 16, 3, 1 prompts: batch-invariant forwards give every
    row the same bits whatever the cut. Without them, rows differ with the cut on this CPU
    (62 of 64 kept their bits at groups of one prompt: the case that makes runs drift)."""
    import random
    from types import SimpleNamespace

    from rlinf_hpc.apps.math.policy import InferenceWorker
    from rlinf_hpc.engines.model import tiny_qwen2

    torch.manual_seed(0)
    tokenizer = CharTokenizer.for_texts(["0123456789+=? "])
    model = tiny_qwen2(
        ModelConfig(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=384), tokenizer, 0
    )
    rng = random.Random(0)
    items = []
    for _ in range(16):
        prompt = [tokenizer.bos_id, *tokenizer.encode(f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=")]
        completions = [[*tokenizer.encode(str(rng.randint(0, 199))), tokenizer.eos_id] for _ in range(4)]
        items.append((prompt, completions))
    grpo = SimpleNamespace(batch_invariant=invariant, micro_batch_tokens=4096)
    worker = SimpleNamespace(config=SimpleNamespace(grpo=grpo), tokenizer=tokenizer, device="cpu")

    def rows(cut: int) -> list[torch.Tensor]:
        out = []
        for start in range(0, len(items), cut):
            part = items[start : start + cut]
            prompts = [p for p, cs in part for _ in cs]
            completions = [c for _, cs in part for c in cs]
            with torch.no_grad():
                out += InferenceWorker._micro_batched(
                    worker, model.eval(), prompts, completions, [4] * len(part)
                )
        return out

    whole = rows(16)
    same = {cut: sum(torch.equal(a, b) for a, b in zip(whole, rows(cut), strict=True)) for cut in (3, 1)}
    if invariant:
        assert same == {3: 64, 1: 64}, same
    else:  # the control, on this machine's kernels: a prompt alone in its micro-batch moves bits
        assert same[1] < 64, same
