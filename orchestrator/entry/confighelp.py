"""`flotilla config [SECTION]`: every field of the run config, from the models themselves.

Types, defaults and the docstring under each field come from the pydantic models
(`use_attribute_docstrings=True`), so this help cannot drift from the code.
"""

from __future__ import annotations

import json
import typing
from types import UnionType
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

__all__ = ["config_help"]


def _type_name(t: Any) -> str:
    origin = typing.get_origin(t)
    if origin is typing.Annotated:
        return _type_name(typing.get_args(t)[0])
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in typing.get_args(t))
    if origin in (typing.Union, UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(t))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(t))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if t is type(None):
        return "None"
    return getattr(t, "__name__", str(t))


def _model_of(t: Any) -> type[BaseModel] | None:
    """The config model a field holds (itself, or the items of a list of them)."""
    if typing.get_origin(t) is typing.Annotated:
        t = typing.get_args(t)[0]
    if typing.get_origin(t) is list:
        t = typing.get_args(t)[0]
    return t if isinstance(t, type) and issubclass(t, BaseModel) else None


def _default(field: Any) -> str:
    if field.default is not PydanticUndefined:
        return json.dumps(field.default, default=str)
    if field.default_factory is not None:
        value = field.default_factory()
        return "(see below)" if isinstance(value, BaseModel) else json.dumps(value, default=str)
    return "required"


def _lines(model: type[BaseModel], prefix: str, out: list[str]) -> None:
    nested: list[tuple[str, type[BaseModel], bool]] = []
    for name, field in model.model_fields.items():
        sub = _model_of(field.annotation)
        if sub is not None:
            nested.append(
                (
                    name,
                    sub,
                    typing.get_origin(field.annotation) is list
                    or typing.get_origin(
                        typing.get_args(field.annotation)[0]
                        if typing.get_origin(field.annotation) is typing.Annotated
                        else None
                    )
                    is list,
                )
            )
            continue
        out.append(f"  {name}: {_type_name(field.annotation)} = {_default(field)}")
        for doc_line in (field.description or "(undocumented)").split("\n"):
            out.append(f"      {doc_line.strip()}")
    for name, sub, is_list in nested:
        header = f"[[{prefix}{name}]]" if is_list else f"[{prefix}{name}]"
        doc = model.model_fields[name].description
        out.append("")
        out.append(header + (f"  # {doc.splitlines()[0]}" if doc else ""))
        _lines(sub, f"{prefix}{name}.", out)


def config_help(section: str | None = None) -> str:
    """The fields of the run config (or of one `section`), one block per table."""
    from orchestrator.state.config import ConfigError, RunConfig

    model: type[BaseModel] = RunConfig
    prefix = ""
    if section:
        field = RunConfig.model_fields.get(section)
        sub = _model_of(field.annotation) if field is not None else None
        if sub is None:
            sections = [n for n, f in RunConfig.model_fields.items() if _model_of(f.annotation)]
            raise ConfigError(f"no config section {section!r}; sections: {', '.join(sections)}")
        model, prefix = sub, f"{section}."
        out = [f"[{section}]"]
    else:
        out = ["(top level)"]
    _lines(model, prefix, out)
    return "\n".join(out)
