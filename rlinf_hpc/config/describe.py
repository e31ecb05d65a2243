"""List every config key with its type, default and description (``rlinf-hpc config schema``):
the framework's, then each app's own sections under the app's name."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from rlinf_hpc.config.apps import App
from rlinf_hpc.config.schema import Config


@dataclass(frozen=True)
class KeyDoc:
    """One documented config key."""

    key: str
    type: str
    default: str
    doc: str


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "")
    return text


def _walk(model: type[BaseModel], prefix: str) -> typing.Iterator[KeyDoc]:
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _walk(annotation, f"{key}.")
            continue
        if typing.get_origin(annotation) is dict:
            value_type = typing.get_args(annotation)[1]
            if isinstance(value_type, type) and issubclass(value_type, BaseModel):
                yield from _walk(value_type, f"{key}.<name>.")
                continue
        if field.default is not PydanticUndefined:
            default = repr(field.default)
        elif field.default_factory is not None:
            default = repr(field.default_factory())
        else:
            default = "(required)"
        yield KeyDoc(key, _type_name(annotation), default, field.description or "")


def schema_keys(app: App | None = None) -> list[KeyDoc]:
    """Every leaf key of the framework's `Config` (``app`` None) or of ``app``'s own sections,
    in declaration order."""
    if app is None:
        return list(_walk(Config, ""))
    return [key for name, section in app.sections.items() for key in _walk(section, f"{name}.")]
