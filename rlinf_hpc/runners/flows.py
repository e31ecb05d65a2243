"""Find the macro flow named by ``[flow] runner``: a built-in name or ``module:function``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlinf_hpc.errors import UserError
from rlinf_hpc.imports import import_path

BUILTIN_FLOWS = {
    "hello": "rlinf_hpc.runners.hello:hello_flow",
    "toy_pipeline": "rlinf_hpc.runners.toy:toy_pipeline_flow",
    "math_grpo": "rlinf_hpc.runners.math_grpo:math_grpo_flow",
}

Flow = Callable[[Any], Any]


def resolve_flow(name: str) -> Flow:
    """The flow function for ``name``. Raises `UserError` naming the fix when it is not found."""
    path = BUILTIN_FLOWS.get(name, name)
    if ":" not in path:
        raise UserError(
            f"flow.runner = '{name}' is neither a built-in flow ({', '.join(BUILTIN_FLOWS)}) nor "
            "an import path 'package.module:function'."
        )
    flow = import_path(path, "flow.runner")
    if not callable(flow):
        raise UserError(f"flow.runner = '{name}' is not a function.")
    return flow
