"""Applications: a flow plus the config sections it declares, found by ``[flow] runner``.

The framework holds no application. An app (the built-in ``math_grpo``, or a user's own package)
is an `App` object naming its flow function (an import path, imported only when the job runs)
and its config sections; the job's `Config` class is the framework's sections plus the app's,
built here once per app, so an app's keys are validated, suggested and documented exactly like
the framework's. ``[flow] runner`` is one of

- a registered name (the ``rlinf_hpc.apps`` entry-point group: the built-in ``hello``,
  ``toy_pipeline``, ``math_grpo``, ``embodied_ppo``, and any installed package that registers one),
- an import path ``package.module:APP`` of an `App`,
- an import path ``package.module:function`` of a bare flow (no sections of its own; its
  free-form parameters go in ``[flow] options``).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any

from pydantic import Field, create_model, model_validator

from rlinf_hpc.config.section import Section
from rlinf_hpc.errors import UserError
from rlinf_hpc.imports import import_path

if TYPE_CHECKING:
    from rlinf_hpc.config.schema import Config

ENTRY_POINTS = "rlinf_hpc.apps"


@dataclass(frozen=True, eq=False)  # compared and cached by identity
class App:
    """What an application declares to the framework.

    ``flow`` and ``validate`` are import paths (``module:function``) so that loading a config
    imports no model code. ``validate(config)`` runs before any rank starts (in `rlinf-hpc run`,
    then on rank 0; files, model directories: raise `UserError`) — keep its module free of
    torch, or every launch pays for the import; ``check(config)`` runs inside config validation
    (checks across sections: raise ValueError, its message names the keys). The key patterns
    extend the checkpoint store's: ``resumable_keys`` may change between a run and its resume,
    ``fixed_keys`` never may (``"model."`` is a prefix, ``"grpo.steps"`` a key).
    """

    name: str
    flow: str
    sections: Mapping[str, type[Section]] = field(default_factory=dict)
    validate: str = ""
    check: Callable[[Any], None] | None = None
    resumable_keys: tuple[str, ...] = ()
    fixed_keys: tuple[str, ...] = ()
    description: str = ""

    def flow_function(self) -> Callable[[Any], Any]:
        flow = import_path(self.flow, f"app '{self.name}': flow")
        if not callable(flow):
            raise UserError(f"app '{self.name}': flow '{self.flow}' is not a function.")
        return flow

    def validate_function(self) -> Callable[[Any], None] | None:
        if self.validate:
            return import_path(self.validate, f"app '{self.name}': validate")
        return getattr(self.flow_function(), "validate", None)  # a bare flow's own checks


@cache
def registered_apps() -> dict[str, str]:
    """Registered app names -> import paths of their `App` (the entry-point group)."""
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINTS)}


@cache
def resolve_app(runner: str) -> App:
    """The `App` that ``[flow] runner = runner`` names. `UserError` saying what to fix."""
    registered = registered_apps()
    path = registered.get(runner, runner)
    if ":" not in path:
        names = ", ".join(registered) or "none: reinstall rlinf_hpc (pip install -e .)"
        raise UserError(
            f"flow.runner = '{runner}' is neither a registered app ({names}) nor an import path "
            "'package.module:APP' (an rlinf_hpc App) or 'package.module:function' (a bare flow)."
        )
    target = import_path(path, "flow.runner")
    if isinstance(target, App):
        _check_sections(target)
        return target
    if callable(target):
        return App(name=runner, flow=path)
    raise UserError(f"flow.runner = '{runner}' is neither an rlinf_hpc App nor a function.")


def _check_sections(app: App) -> None:
    from rlinf_hpc.config.schema import Config

    for name, section in app.sections.items():
        if name in Config.model_fields:
            raise UserError(
                f"app '{app.name}' declares a config section [{name}], which the framework already "
                f"has; rename it (framework sections: {', '.join(Config.model_fields)})."
            )
        if not (isinstance(section, type) and issubclass(section, Section)):
            raise UserError(
                f"app '{app.name}': section [{name}] must be a subclass of "
                "rlinf_hpc.config.section.Section (unknown keys refused, assignments validated)."
            )


@cache
def config_class(app: App) -> type[Config]:
    """`Config` with ``app``'s sections as fields (defaults filled in) and its cross-section check."""
    from rlinf_hpc.config.schema import Config

    if not app.sections and app.check is None:
        return Config
    fields: dict[str, Any] = {
        name: (section, Field(default_factory=section, description=f"{app.name}: {_first_line(section)}"))
        for name, section in app.sections.items()
    }
    validators: dict[str, Any] = {}
    if app.check is not None:
        check = app.check

        def _check_app(self: Any) -> Any:
            check(self)
            return self

        validators["_check_app"] = model_validator(mode="after")(_check_app)
    name = "".join(part.capitalize() for part in app.name.replace("-", "_").split("_")) + "JobConfig"
    return create_model(name, __base__=Config, __validators__=validators, **fields)


def _first_line(section: type[Section]) -> str:
    return (section.__doc__ or section.__name__).strip().splitlines()[0]


def owner_of_section(name: str) -> str | None:
    """The registered app that declares section [name], if one does (for hints)."""
    for runner in registered_apps():
        try:
            if name in resolve_app(runner).sections:
                return runner
        except UserError:
            continue
    return None


def runner_of(data: Mapping[str, Any]) -> str:
    """``flow.runner`` of a parsed, not yet validated config (its default when unset; a wrong
    type is left for validation to report)."""
    from rlinf_hpc.config.schema import FlowConfig

    flow = data.get("flow")
    runner = flow.get("runner") if isinstance(flow, Mapping) else None
    return runner if isinstance(runner, str) else FlowConfig.model_fields["runner"].default


def require_components(config: Config, names: tuple[str, ...], flow: str) -> None:
    """`UserError` naming the first missing one when ``config`` lacks any of ``names``."""
    missing = [name for name in names if name not in config.components]
    if missing:
        raise UserError(
            f"the {flow} flow needs components {', '.join(names)}; the config lacks "
            f"{', '.join(missing)} (add [components.{missing[0]}])."
        )


def app_of(config: Config) -> App:
    """The app of a validated config."""
    return resolve_app(config.flow.runner)
