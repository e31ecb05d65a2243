"""Resolve ``package.module:Name`` paths named in configs (workers, flows, policies)."""

from __future__ import annotations

import importlib
import sys
from typing import Any

from rlinf_hpc.errors import UserError


def import_path(path: str, what: str, hint: str = "") -> Any:
    """The object ``Name`` of module ``package.module``; `UserError` naming ``what`` otherwise.

    >>> import_path("rlinf_hpc.errors:UserError", "test").__name__
    'UserError'
    """
    module_name, sep, name = path.partition(":")
    if not sep or not module_name or not name:
        raise UserError(f"{what} '{path}' is not an import path 'package.module:Name'.{hint}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(
            f"{what} '{path}': cannot import module '{module_name}' ({exc}). Check the name and "
            f"that the module is installed on every node.{hint}"
        ) from None
    obj = getattr(module, name, None)
    if obj is None:
        raise UserError(f"{what} '{path}': '{name}' in module '{module_name}' is missing.{hint}")
    return obj


def import_subclass(path: str, base: type, what: str, hint: str = "") -> type:
    """`import_path`, then insist on a subclass of ``base``."""
    obj = import_path(path, what, hint)
    if not (isinstance(obj, type) and issubclass(obj, base)):
        name = path.partition(":")[2]
        module = path.partition(":")[0]
        raise UserError(
            f"{what} '{path}': '{name}' in module '{module}' is not a subclass of "
            f"{base.__module__.replace('.base', '')}.{base.__qualname__}.{hint}"
        )
    return obj


def loaded(name: str) -> Any:
    """Module ``name`` if it is imported *completely*, else None: never imports it.

    A module another thread is still importing is in ``sys.modules`` half made (torch without
    ``torch.cuda`` yet); code that only reports on what is in use (heartbeats, memory figures,
    packing's type checks) asks here instead of ``sys.modules`` — a rank may import torch late,
    while its heartbeat thread runs.

    Packing asks for every leaf it meets, so a module once seen complete is remembered (a
    dictionary lookup, as cheap as ``sys.modules.get``).

    >>> loaded("sys") is sys, loaded("surely_not_a_module_name")
    (True, None)
    """
    module = _COMPLETE.get(name)
    if module is not None:
        return module
    module = sys.modules.get(name)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    _COMPLETE[name] = module
    return module


#: Modules `loaded` has seen completely imported.
_COMPLETE: dict[str, Any] = {}
