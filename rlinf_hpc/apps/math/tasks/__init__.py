"""RL tasks: problem sets and their verifiers."""

from rlinf_hpc.apps.math.tasks.problems import (
    ArithmeticTask,
    JsonlTask,
    Problem,
    load_jsonl_problems,
    load_parquet_problems,
    make_task,
    vocabulary_texts,
)
from rlinf_hpc.apps.math.tasks.verifier import Score, extract_answer, normalize_number, score_completion

__all__ = [
    "ArithmeticTask",
    "JsonlTask",
    "Problem",
    "Score",
    "extract_answer",
    "load_jsonl_problems",
    "load_parquet_problems",
    "make_task",
    "normalize_number",
    "score_completion",
    "vocabulary_texts",
]
