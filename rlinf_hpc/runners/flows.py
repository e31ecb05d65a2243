"""Find the macro flow named by ``[flow] runner``: a built-in name or ``module:function``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from rlinf_hpc.errors import UserError

BUILTIN_FLOWS = {"hello": "rlinf_hpc.runners.hello:hello_flow"}

Flow = Callable[[Any], Any]


def resolve_flow(name: str) -> Flow:
    """The flow function for ``name``. Raises `UserError` naming the fix when it is not found."""
    path = BUILTIN_FLOWS.get(name, name)
    module_name, sep, function_name = path.partition(":")
    if not sep:
        raise UserError(
            f"flow.runner = '{name}' is neither a built-in flow ({', '.join(BUILTIN_FLOWS)}) nor "
            "an import path 'package.module:function'."
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"flow.runner = '{name}': cannot import '{module_name}' ({exc}).") from None
    flow = getattr(module, function_name, None)
    if not callable(flow):
        raise UserError(f"flow.runner = '{name}': '{module_name}' has no function '{function_name}'.")
    return flow
