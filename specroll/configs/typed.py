"""Building nested config dataclasses from plain containers (YAML / Hydra), strictly.

OmegaConf's structured configs cannot express the `Literal` fields of the learner's
configs, so the conversion is ours: every key must be a field, every value must have the
field's type, and any error names the dotted path of the field, e.g. `rollout.speculation.max_nodes`:
a config's own `FieldError` names its field, and the path of the config is prepended here.
"""
from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from specroll.config_checks import FieldError


def build_dataclass(cls: type, values: Any, path: str = "") -> Any:
    """An instance of dataclass `cls` from a mapping of its fields (nested ones too).

    Keys left out take the dataclass defaults. Raises `ValueError` naming the field's dotted
    path for an unknown key, a value of the wrong type, or a value the dataclass rejects.
    """
    if isinstance(values, cls):
        return values
    if not isinstance(values, Mapping):
        raise FieldError(path or "config", values, f"a mapping of {cls.__name__} fields")
    init_fields = [f for f in dataclasses.fields(cls) if f.init]
    names = [f.name for f in init_fields]
    unknown = [key for key in values if key not in names]
    if unknown:
        raise ValueError(f"{join(path, str(unknown[0]))}: unknown key; {path or 'the config'} has {', '.join(names)}")
    hints = get_type_hints(cls)
    # Field order, not input order: a later field's check may rely on an earlier one's.
    kwargs = {name: convert(hints[name], values[name], join(path, name)) for name in names if name in values}
    try:
        return cls(**kwargs)
    except FieldError as exc:
        raise exc.within(path) from exc


def convert(hint: Any, value: Any, path: str) -> Any:
    """`value` checked against the type annotation `hint` (and converted: lists to tuples, ints to floats)."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return convert(arg, value, path)
            except ValueError as exc:
                errors.append(exc)
        raise FieldError(path, value, describe(hint)) from errors[0]
    if origin is Literal:
        if any(value == option and type(value) is type(option) for option in args):
            return value
        raise FieldError(path, value, describe(hint))
    if dataclasses.is_dataclass(hint):
        return build_dataclass(hint, value, path)
    if origin in (tuple, list):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise FieldError(path, value, describe(hint))
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise FieldError(path, value, describe(hint))
            return tuple(convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        items = [convert(args[0] if args else Any, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or hint is dict:
        if not isinstance(value, Mapping):
            raise FieldError(path, value, "a mapping")
        return dict(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    else:
        return value
    raise FieldError(path, value, describe(hint))


def describe(hint: Any) -> str:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (tuple, list):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return f"a list of {len(args)} values ({', '.join(describe(a) for a in args)})"
        return f"a list of {describe(args[0]) if args else 'values'}"
    return {bool: "a bool", int: "an int", float: "a number", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )


def join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
