"""Strict pydantic base for every spec, and one-line error reporting at the edge.

Specs are validated where they enter (YAML files, CLI flags, HF configs). A bad value becomes a
`ConfigError` whose message is a single line: `<source>: <field.path>: <problem> (got <value>)`.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

T = TypeVar("T", bound=BaseModel)


class ConfigError(ValueError):
    """A user-facing configuration problem; its message is one line naming the field and the fix."""


class StrictModel(BaseModel):
    """Unknown keys are errors; no silent coercion of str to int, of a bool to a number (`steps: true` is not 1
    step), and no NaN / infinity in float fields."""

    model_config = ConfigDict(extra="forbid", strict=False, frozen=False, validate_assignment=True,
                              allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name) if info.field_name else None
        if field is not None and _holds_bool_for_number(value, field.annotation):
            raise ValueError(f"expected a number, got {value!r} (a boolean); write the number itself")
        return value


def _numeric(annotation: Any) -> bool:
    """int / float, or a union of them (None allowed): a type a bool must not pass as."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return bool(args) and all(_numeric(a) for a in args)
    return annotation in (int, float)


def _holds_bool_for_number(value: Any, annotation: Any) -> bool:
    if isinstance(value, bool):
        return _numeric(annotation)
    origin = typing.get_origin(annotation)
    if isinstance(value, (list, tuple)) and origin in (tuple, list):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        return any(isinstance(v, bool) and args and _numeric(args[min(i, len(args) - 1)]) for i, v in
                   enumerate(value))
    return False


def _loc(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if not (isinstance(p, str) and p.startswith("function-"))]
    return ".".join(parts) or "<root>"


def format_validation_error(err: ValidationError, source: str) -> str:
    """First (most specific) problem as one line; a count of further problems if any."""
    errors = err.errors(include_url=False)
    first = errors[0]
    loc = _loc(first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown key (check spelling; see the preset YAMLs for valid keys)"
    got = first.get("input")
    got_s = repr(got)
    if len(got_s) > 60:
        got_s = got_s[:57] + "..."
    more = f" [+{len(errors) - 1} more]" if len(errors) > 1 else ""
    value_part = "" if first["type"] in ("missing",) or isinstance(got, dict) else f" (got {got_s})"
    return f"{source}: {loc}: {msg}{value_part}{more}"


def validate(cls: type[T], data: Any, source: str) -> T:
    """Build `cls` from plain data, turning validation failures into a one-line ConfigError."""
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: file not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{p}:{where}: not valid YAML ({getattr(err, 'problem', err)})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping of keys, got {type(data).__name__}")
    return data


def dump_yaml(model: BaseModel, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(model.model_dump(mode="json"), sort_keys=False))
