"""Load a TOML file into a validated `Config`, apply ``--set`` overrides, explain mistakes.

Every problem becomes a `UserError` whose message names the file, the dotted key, what is wrong
and how to fix it (nearest valid key for typos, line/column for TOML syntax errors).
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any

import tomli_w
import tomllib
from pydantic import BaseModel, ValidationError

from rlinf_hpc.config.apps import config_class, owner_of_section, resolve_app, runner_of
from rlinf_hpc.config.schema import Config
from rlinf_hpc.errors import UserError

_SCHEMA_HINT = "Run `rlinf-hpc config schema` to list every key with its type, default and meaning."


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b=c`` into (["a", "b"], value); the value is read as TOML, else as a string.

    >>> parse_override("job.num_ranks=8")
    (['job', 'num_ranks'], 8)
    >>> parse_override("components.actor.device=gpu")
    (['components', 'actor', 'device'], 'gpu')
    """
    key, sep, raw = text.partition("=")
    parts = [p.strip() for p in key.strip().split(".")]
    if not sep or not all(parts):
        raise UserError(
            f"--set '{text}' is not of the form KEY=VALUE with a dotted KEY (e.g. --set job.num_ranks=8)."
        )
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return parts, value


def _apply_override(data: dict[str, Any], parts: list[str], value: Any, text: str) -> None:
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            prefix = ".".join(parts[: depth + 1])
            raise UserError(
                f"--set '{text}': `{prefix}` is a value, not a table, so it has no key "
                f"`{parts[depth + 1]}`. {_SCHEMA_HINT}"
            )
        node = child
    node[parts[-1]] = value


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise UserError(
            f"config file '{path}' does not exist. Pass the path of a TOML job config, "
            "e.g. `rlinf-hpc run configs/hello.toml`."
        )
    if not path.is_file():
        raise UserError(f"config path '{path}' is a directory, not a TOML file.")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise UserError(
            f"config file '{path}' is not valid TOML: {exc}. Fix the syntax at that line and column."
        ) from None
    except UnicodeDecodeError as exc:
        raise UserError(f"config file '{path}' is not UTF-8 text ({exc}).") from None


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _valid_keys_at(schema: type[Config], loc: tuple[Any, ...]) -> list[str]:
    """Field names allowed in the table at ``loc`` (a pydantic error location without the key)."""
    current: Any = schema
    for part in loc:
        model = _model_of(current)
        if model is not None:
            field = model.model_fields.get(str(part))
            if field is None:
                return []
            current = field.annotation
            continue
        origin = typing.get_origin(current)
        if origin is dict:
            current = typing.get_args(current)[1]
        elif origin in (typing.Union, types.UnionType):
            arms = [a for a in typing.get_args(current) if _model_of(a)]
            current = arms[0] if arms else None
        else:
            return []
    model = _model_of(current)
    return list(model.model_fields) if model else []


def _describe_error(schema: type[Config], err: dict[str, Any], overridden: set[str]) -> str:
    loc = tuple(err["loc"])
    dotted = ".".join(str(p) for p in loc) or "(top level)"
    touched = any(key == dotted or key.startswith(dotted + ".") for key in overridden)
    origin = " (set with --set)" if touched else ""
    if err["type"] == "extra_forbidden":
        valid = _valid_keys_at(schema, loc[:-1])
        near = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
        hint = f" Did you mean `{near[0]}`?" if near else ""
        table = ".".join(str(p) for p in loc[:-1])
        where = f"[{table}]" if table else "the top level"
        owner = owner_of_section(str(loc[-1])) if not table and not near else None
        if owner:
            return (
                f"section [{dotted}]{origin} belongs to the app '{owner}', but flow.runner names "
                f'another. Set flow.runner = "{owner}", or remove [{dotted}].'
            )
        return f"unknown key `{dotted}`{origin}.{hint} Valid keys in {where}: {', '.join(valid)}."
    if err["type"] == "missing":
        return f"`{dotted}` is required but missing."
    if err["type"] == "literal_error":
        allowed = re.findall(r"'([^']*)'", str(err.get("ctx", {}).get("expected", "")))
        given = str(err.get("input"))
        prefixed = sorted((a for a in allowed if a.startswith(given)), key=len)  # a cut-off name
        near = prefixed[:1] or difflib.get_close_matches(given, allowed, n=1, cutoff=0.4)
        hint = f" Did you mean '{near[0]}'?" if near else ""
        return f"`{dotted}`{origin} is {err.get('input')!r}, not one of {', '.join(allowed)}.{hint}"
    message = str(err["msg"]).removeprefix("Value error, ")
    if not loc:  # a check across sections: its message names the keys itself
        return message + "."
    got = err.get("input")
    if isinstance(got, dict) and err["type"] == "value_error":  # a check across a section's keys
        return f"[{dotted}]{origin}: {message}."
    if isinstance(got, dict):
        return f"`{dotted}`{origin}: {message}, got a table."
    return f"`{dotted}`{origin}: {message}, got {got!r}."


def config_from_dict(data: dict[str, Any], source: str, overridden: set[str] | None = None) -> Config:
    """Validate an already-parsed dict against the framework's sections and those of the app
    that ``flow.runner`` names; errors name ``source`` (a path or "--set")."""
    try:
        schema = config_class(resolve_app(runner_of(data)))
    except UserError as exc:
        raise UserError(f"config error in '{source}': {exc}") from None
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        problems = " ".join(_describe_error(schema, e, overridden or set()) for e in exc.errors())
        raise UserError(f"config error in '{source}': {problems} {_SCHEMA_HINT}") from None


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read ``path``, apply ``KEY=VALUE`` overrides in order, validate. Raises `UserError`."""
    path = Path(path)
    data = _read_toml(path)
    overridden: set[str] = set()
    for text in overrides:
        parts, value = parse_override(text)
        _apply_override(data, parts, value, text)
        overridden.add(".".join(parts))
    return config_from_dict(data, str(path), overridden)


def config_to_toml(config: Config) -> str:
    """The resolved config as TOML (defaults filled in; unset optional keys left out)."""
    return tomli_w.dumps(config.model_dump(mode="json", exclude_none=True))
