"""Command-line flags from a config dataclass: one `--field-name` per field, its default the
field's and its help the field's documentation (the comment ending its line, or the string right
below it), so a command never copies a config's fields, defaults or descriptions by hand."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import types
import typing
from typing import Any, TypeVar

Config = TypeVar("Config")
FLAG_TYPES = (bool, int, float, str)


def class_source(cls: type) -> tuple[ast.ClassDef, str]:
    source = textwrap.dedent(inspect.getsource(cls))
    return ast.parse(source).body[0], source


def field_docs(cls: type) -> dict[str, str]:
    """Each field's documentation in dataclass `cls` and its dataclass bases: the `# comment`
    ending its line, or else the string literal right below it."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        node, source = class_source(klass)
        comments = {token.start[0]: token.string.lstrip("#").strip()
                    for token in tokenize.generate_tokens(io.StringIO(source).readline)
                    if token.type == tokenize.COMMENT}
        body = node.body
        for statement, below in zip(body, body[1:] + [None]):
            if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
                continue
            is_docstring = (isinstance(below, ast.Expr) and isinstance(below.value, ast.Constant)
                            and isinstance(below.value.value, str))
            doc = inspect.cleandoc(below.value.value) if is_docstring else comments.get(statement.end_lineno)
            if doc:
                docs[statement.target.id] = " ".join(doc.split())
    return docs


def flag_type(annotation: Any) -> type | None:
    """The type a flag parses for a field of this annotation (None allowed alongside it); None
    where a field takes no flag (lists, tuples, nested configs)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        return kinds[0] if len(kinds) == 1 and kinds[0] in FLAG_TYPES else None
    return annotation if annotation in FLAG_TYPES else None


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"field {f.name} has no default: a flag for it would be required")


def add_config_arguments(parser: argparse.ArgumentParser, cls: type, exclude: tuple[str, ...] = (),
                         defaults: dict[str, Any] | None = None) -> None:
    """Add a `--field-name` flag to `parser` for each field of dataclass `cls` but those in
    `exclude`, in a group named after the class; `defaults` replaces the fields' own."""
    hints, docs, defaults = typing.get_type_hints(cls), field_docs(cls), defaults or {}
    summary = ast.get_docstring(class_source(cls)[0])  # not __doc__: a dataclass without one gets its signature
    group = parser.add_argument_group(cls.__name__, summary.splitlines()[0] if summary else None)
    for f in dataclasses.fields(cls):
        if f.name in exclude or not f.init:
            continue
        kind = flag_type(hints[f.name])
        if kind is None:
            raise TypeError(f"{cls.__name__}.{f.name} ({hints[f.name]}) takes no flag: exclude it")
        default = defaults.get(f.name, field_default(f))
        flag, help_text = "--" + f.name.replace("_", "-"), docs.get(f.name, "").replace("%", "%%")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            group.add_argument(flag, type=kind, default=default, help=f"{help_text} (default: {default})")


def config_from_args(cls: type[Config], args: argparse.Namespace, parser: argparse.ArgumentParser | None = None,
                     **given: Any) -> Config:
    """`cls` built from the parsed flags of its fields and the `given` values. With `parser`, a
    value the config's checks refuse ends the command with its usage and the check's message."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if f.init and f.name not in given and hasattr(args, f.name)}
    try:
        return cls(**values, **given)
    except ValueError as exc:
        if parser is None:
            raise
        parser.error(str(exc))
