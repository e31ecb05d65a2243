"""Arithmetic problems generated locally and deterministically, GSM8K-style JSONL files, and
veRL's Parquet layout (``prompt`` as chat messages, ``reward_model.ground_truth``).

A problem is a prompt and its exact answer. Generated prompts zero-pad operands to ``digits`` so
every prompt of a task has the same length (``"07+45="`` -> ``"52"``); operations are evaluated
with the usual precedence. The held-out split is drawn from its own random stream and its prompts
are excluded from training, so evaluation never sees a trained problem.

>>> task = ArithmeticTask(digits=2, operations=("+",), terms=2, eval_size=3, seed=0)
>>> [len(p.prompt) for p in task.eval_problems()]
[6, 6, 6]
>>> p = task.train_problem(0); sum(int(n) for n in p.prompt[:-1].split("+")) == int(p.answer)
True
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlinf_hpc.apps.math.config import TaskConfig
from rlinf_hpc.apps.math.tasks.prompts import PromptFormat, RawPrompt
from rlinf_hpc.errors import UserError


@dataclass(frozen=True)
class Problem:
    """One problem: ``uid`` is unique within its split; ``answer`` is a normalized integer;
    ``prompt`` a question or chat messages (`rlinf_hpc.apps.math.tasks.prompts`)."""

    uid: int
    prompt: RawPrompt
    answer: str


class ArithmeticTask:
    """Deterministic problem streams: ``train_problem(i)`` and the fixed ``eval_problems()``."""

    def __init__(self, digits: int, operations: Sequence[str], terms: int, eval_size: int, seed: int) -> None:
        self.digits = digits
        self.operations = tuple(operations)
        self.terms = terms
        self.seed = seed
        space = (10**digits) ** terms * len(self.operations) ** (terms - 1)
        if eval_size * 4 > space:
            raise UserError(
                f"task.eval_size = {eval_size} is too large for {digits}-digit problems with "
                f"{terms} terms ({space} distinct problems): held-out problems would crowd out "
                "training ones. Lower task.eval_size or raise task.digits / task.terms."
            )
        rng = random.Random(f"{seed}:eval")
        problems: dict[str, Problem] = {}
        while len(problems) < eval_size:
            problem = self._draw(rng, len(problems))
            problems.setdefault(problem.prompt, problem)
        self._eval = list(problems.values())
        self._held_out = set(problems)

    def _draw(self, rng: random.Random, uid: int) -> Problem:
        numbers = [rng.randrange(10**self.digits) for _ in range(self.terms)]
        ops = [rng.choice(self.operations) for _ in range(self.terms - 1)]
        expression = f"{numbers[0]:0{self.digits}d}" + "".join(
            f"{op}{n:0{self.digits}d}" for op, n in zip(ops, numbers[1:], strict=True)
        )
        return Problem(uid, expression + "=", str(_evaluate(numbers, ops)))

    def train_problem(self, index: int, stream: str = "rl") -> Problem:
        """Training problem number ``index`` of ``stream`` (the same for every rank and run)."""
        rng = random.Random(f"{self.seed}:{stream}:{index}")
        while True:
            problem = self._draw(rng, index)
            if problem.prompt not in self._held_out:
                return problem

    def train_batch(self, step: int, size: int, stream: str = "rl") -> list[Problem]:
        """The ``size`` training problems of step ``step``."""
        return [self.train_problem(step * size + i, stream) for i in range(size)]

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def texts(self) -> list[str]:
        """Text the tokenizer must cover (the character set of every problem)."""
        return ["0123456789" + "".join(self.operations) + "=-"]


def _evaluate(numbers: list[int], ops: list[str]) -> int:
    """Integer value with * before + and -, without eval()."""
    terms = [numbers[0]]
    signs = [1]
    for op, n in zip(ops, numbers[1:], strict=True):
        if op == "*":
            terms[-1] *= n
        else:
            terms.append(n)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms, strict=True))


_FINAL = re.compile(r"####\s*(.+?)\s*$")


def load_jsonl_problems(path: str | Path, what: str) -> list[Problem]:
    """GSM8K-style lines ``{"question": ..., "answer": "... #### 42"}`` (or ``answer`` a number).

    Raises `UserError` naming the file and line of the first bad record.
    """
    from rlinf_hpc.apps.math.tasks.verifier import normalize_number

    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"{what} = '{path}' is not a file. Give the path of a JSONL file of problems.")
    problems = []
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        bad_line = file.read_bytes()[: exc.start].count(b"\n") + 1
        raise UserError(
            f"{file}:{bad_line}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
            "save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)."
        ) from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(
                f"{file}:{number}: not valid JSON ({exc.msg}); each line must be one object."
            ) from None
        missing = [k for k in ("question", "answer") if not isinstance(record, dict) or k not in record]
        if missing:
            raise UserError(
                f"{file}:{number}: the record has no {' and no '.join(repr(m) for m in missing)} field; "
                'each line needs {"question": "...", "answer": "... #### <number>"}.'
            )
        raw = str(record["answer"])
        match = _FINAL.search(raw)
        answer = normalize_number(match.group(1) if match else raw)
        if answer is None:
            raise UserError(
                f"{file}:{number}: the answer {raw[-40:]!r} does not end in '#### <number>'; "
                "the verifier needs a final numeric answer."
            )
        problems.append(Problem(len(problems), str(record["question"]).strip(), answer))
    if not problems:
        raise UserError(f"{what} = '{path}' holds no problems.")
    return problems


#: The columns of veRL's Parquet layout this reader takes (examples/data_preprocess/gsm8k.py).
PARQUET_COLUMNS = ("prompt", "reward_model")


def load_parquet_problems(path: str | Path, what: str) -> list[Problem]:
    """Rows of veRL's layout: ``prompt`` (a list of ``{"role", "content"}`` messages, or a
    string) and ``reward_model`` (a struct whose ``ground_truth`` is the final number).

    Raises `UserError` naming the file and row of the first bad record, or the missing columns.
    """
    from rlinf_hpc.apps.math.tasks.verifier import normalize_number

    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"{what} = '{path}' is not a file. Give the path of a Parquet file of problems.")
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError:
        raise UserError(
            f'task.kind = "parquet" reads {file} with pyarrow, which is not installed: '
            "pip install -e '.[parquet]' (or pip install pyarrow)."
        ) from None
    try:
        columns = pq.read_schema(file).names
        missing = [c for c in PARQUET_COLUMNS if c not in columns]
        if missing:
            raise UserError(
                f"{file}: no {' and no '.join(repr(c) for c in missing)} column (it has "
                f"{', '.join(columns)}). veRL's layout has 'prompt' (chat messages) and "
                "'reward_model' ({'ground_truth': ...}); see examples/data_preprocess/gsm8k.py."
            )
        rows = pq.read_table(file, columns=list(PARQUET_COLUMNS)).to_pylist()
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise UserError(f"{file}: not a readable Parquet file ({exc}).") from None
    problems = []
    for number, row in enumerate(rows):
        prompt, reward = row["prompt"], row["reward_model"]
        truth = reward.get("ground_truth") if isinstance(reward, dict) else None
        answer = None if truth is None else normalize_number(str(truth))
        if answer is None:
            raise UserError(
                f"{file}: row {number}: reward_model.ground_truth = {truth!r} is not a number; "
                "the verifier compares final numeric answers."
            )
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in prompt)
        ):
            prompt = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
        elif not isinstance(prompt, str) or not prompt.strip():
            raise UserError(
                f"{file}: row {number}: 'prompt' is neither chat messages "
                "([{'role': ..., 'content': ...}, ...]) nor text."
            )
        problems.append(Problem(len(problems), prompt, answer))
    if not problems:
        raise UserError(f"{what} = '{path}' holds no problems.")
    return problems


def _prompt_text(prompt: RawPrompt) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


class JsonlTask:
    """Problems from files (GSM8K-style JSONL or veRL's Parquet): a fixed training list
    (cycled in a seeded order per epoch) and a held-out list."""

    def __init__(self, train_path: str, eval_path: str, seed: int, kind: str = "jsonl") -> None:
        load = load_parquet_problems if kind == "parquet" else load_jsonl_problems
        self._train = load(train_path, "task.train_path")
        self._eval = load(eval_path, "task.eval_path")
        self.seed = seed

    def train_problem(self, index: int, stream: str = "rl") -> Problem:
        epoch, position = divmod(index, len(self._train))
        order = list(range(len(self._train)))
        random.Random(f"{self.seed}:{stream}:{epoch}").shuffle(order)
        problem = self._train[order[position]]
        return Problem(index, problem.prompt, problem.answer)

    def train_batch(self, step: int, size: int, stream: str = "rl") -> list[Problem]:
        return [self.train_problem(step * size + i, stream) for i in range(size)]

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def train_problems(self) -> list[Problem]:
        """The training file's problems in file order."""
        return list(self._train)

    def texts(self) -> list[str]:
        return [_prompt_text(p.prompt) + p.answer for p in self._train + self._eval]


def make_task(config: TaskConfig, seed: int) -> ArithmeticTask | JsonlTask:
    """The task named by ``[task]`` (`UserError` for unreadable or malformed files)."""
    if config.kind != "arithmetic":
        return JsonlTask(config.train_path, config.eval_path, seed, config.kind)
    return ArithmeticTask(config.digits, config.operations, config.terms, config.eval_size, seed)


def vocabulary_texts(config: TaskConfig, task: ArithmeticTask | JsonlTask) -> list[str]:
    """What a character tokenizer built for this task must cover: its problems and the text
    the prompt format adds to them."""
    return task.texts() + PromptFormat.of_task(config).texts()
