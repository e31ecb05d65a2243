"""The warm start's teacher: who writes the answers the supervised warm start imitates.

``exact`` writes the right answer. ``careless`` is a weak teacher for addition: on a problem
that needs a carry it carries only with probability ``skill`` and otherwise writes every
column's digit sum mod 10 — a plausible, systematic mistake (``27+45=`` -> ``62``). Problems
without a carry (about 30% of 2-digit sums) it always gets right, so at ``skill = 0.15`` it is
right ~40% of the time. A model that imitates it learns the format and the teacher's mistakes;
more supervised training converges to the teacher (greedy: the carry-free answer), and only a
reward from the verifier can take it beyond — which is what the main job's controls show.

The teacher's choice is a function of (seed, problem uid), the same on every rank and run.

>>> careless_sum([27, 45]), careless_sum([87, 45]), careless_sum([12, 34])
('62', '22', '46')
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from rlinf_hpc.apps.math.config import SFTConfig, TaskConfig
from rlinf_hpc.apps.math.tasks.problems import Problem
from rlinf_hpc.errors import UserError


def careless_sum(numbers: Sequence[int]) -> str:
    """Column-wise digit sums mod 10, no carries, leading zeros dropped."""
    width = max(len(str(n)) for n in numbers)
    columns = [sum(int(str(n).zfill(width)[i]) for n in numbers) % 10 for i in range(width)]
    return str(int("".join(map(str, columns))))


def operands(problem: Problem) -> list[int]:
    """The numbers of a generated sum prompt (``'07+45='`` -> ``[7, 45]``)."""
    return [int(term) for term in problem.prompt.rstrip("=").split("+")]


class Teacher:
    """``answer(problem)``: the target the warm start trains on."""

    def __init__(self, kind: str, skill: float, seed: int) -> None:
        self.kind = kind
        self.skill = skill
        self.seed = seed

    def answer(self, problem: Problem) -> str:
        if self.kind == "exact":
            return problem.answer
        wrong = careless_sum(operands(problem))
        if wrong == problem.answer:
            return wrong  # nothing to carry: the careless teacher is right
        carries = random.Random(f"{self.seed}:teacher:{problem.uid}").random() < self.skill
        return problem.answer if carries else wrong


def check_teacher(sft: SFTConfig, task: TaskConfig) -> None:
    """`UserError` when the teacher cannot write answers for the task."""
    if sft.teacher == "careless" and (task.kind != "arithmetic" or set(task.operations) != {"+"}):
        raise UserError(
            'sft.teacher = "careless" forgets carries in sums, so it needs task.kind = '
            f'"arithmetic" with task.operations = ["+"] (this config: kind "{task.kind}", '
            f'operations {task.operations}); use sft.teacher = "exact" for other tasks.'
        )


def make_teacher(sft: SFTConfig, task: TaskConfig, seed: int) -> Teacher:
    check_teacher(sft, task)
    return Teacher(sft.teacher, sft.teacher_skill, seed)
