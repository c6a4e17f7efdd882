"""Command-line flags of the tools.

A config dataclass is also its command's flags: one `--field-name` per field, its default the
field's and its help the field's documentation (the comment ending its line, or the string right
below it), so a command never copies a config's fields, defaults or descriptions by hand. The
flags every tool shares (the policy, the problems, the output, the seed) are defined here once.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import tokenize
import types
import typing
from typing import Any, TypeVar

from specroll.data.sources import PROBLEM_SOURCES
from specroll.models.loading import DTYPES

Config = TypeVar("Config")
FLAG_TYPES = (bool, int, float, str)
LINT_COMMENTS = ("noqa", "type:", "pragma")  # directives to tools, not documentation
DEFAULT_MODEL = "smollm2-135m-instruct"
TRAINING_DTYPES = ("float32", "bfloat16")  # policy dtypes of the training commands


def class_source(cls: type) -> tuple[ast.ClassDef, dict[int, str]]:
    """The class's syntax tree and the comments of its module by line, parsed from the whole
    module: a class defined inside a function need not parse on its own."""
    module_source = inspect.getsource(inspect.getmodule(cls))
    first_line = inspect.getsourcelines(cls)[1]
    node = next(n for n in ast.walk(ast.parse(module_source)) if isinstance(n, ast.ClassDef)
                and n.name == cls.__name__ and min([n.lineno] + [d.lineno for d in n.decorator_list]) == first_line)
    comments = {token.start[0]: token.string.lstrip("#").strip()
                for token in tokenize.generate_tokens(io.StringIO(module_source).readline)
                if token.type == tokenize.COMMENT and not token.string.lstrip("#").strip().startswith(LINT_COMMENTS)}
    return node, comments


def field_docs(cls: type) -> dict[str, str]:
    """Each field's documentation in dataclass `cls` and its dataclass bases: the string literal
    right below it, or else the `# comment` ending its last line or its first."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        node, comments = class_source(klass)
        for statement, below in zip(node.body, node.body[1:] + [None]):
            if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
                continue
            if (isinstance(below, ast.Expr) and isinstance(below.value, ast.Constant)
                    and isinstance(below.value.value, str)):
                doc = inspect.cleandoc(below.value.value)
            else:
                doc = comments.get(statement.end_lineno) or comments.get(statement.lineno)
            if doc:
                docs[statement.target.id] = " ".join(doc.split())
    return docs


def field_type(cls: type, f: dataclasses.Field) -> Any:
    """A field's annotation, evaluated in its class's module where it is a string (postponed annotations)."""
    if not isinstance(f.type, str):
        return f.type
    owner = next(k for k in cls.__mro__ if f.name in vars(k).get("__annotations__", {}))
    try:
        return eval(f.type, vars(inspect.getmodule(owner)))
    except NameError as exc:
        raise TypeError(f"{cls.__name__}.{f.name}: its type {f.type!r} is not a module-level name ({exc}): "
                        "exclude it") from exc


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
    docs, defaults = field_docs(cls), defaults or {}
    summary = ast.get_docstring(class_source(cls)[0])  # not __doc__: a dataclass without one gets its signature
    group = parser.add_argument_group(cls.__name__, summary.splitlines()[0] if summary else None)
    for f in dataclasses.fields(cls):
        if f.name in exclude or not f.init:
            continue
        annotation = field_type(cls, f)
        kind = flag_type(annotation)
        if kind is None:
            raise TypeError(f"{cls.__name__}.{f.name} ({annotation}) takes no flag: exclude it")
        default = defaults.get(f.name, field_default(f))
        flag, doc = "--" + f.name.replace("_", "-"), docs.get(f.name, "").replace("%", "%%")  # help is %-formatted
        if kind is bool:
            action = group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=doc)
        else:
            action = group.add_argument(flag, type=kind, default=default, help=doc)
        if "%(default)" not in action.help:  # Python 3.10's BooleanOptionalAction adds it itself
            action.help += " (default: %(default)s)"


def config_from_args(cls: type[Config], args: argparse.Namespace, parser: argparse.ArgumentParser | None = None,
                     **given: Any) -> Config:
    """`cls` built from the `given` values and, for its other fields, the parsed flag of the same
    name: its own, or one the command added itself (a `--seed` shared by several configs, say).
    With `parser`, a value the config's checks refuse ends the command with its usage and the
    check's message."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if f.init and f.name not in given and hasattr(args, f.name)}
    try:
        return cls(**values, **given)
    except ValueError as exc:
        if parser is None:
            raise
        parser.error(str(exc))


def add_policy_flags(parser: argparse.ArgumentParser, dtypes: tuple[str, ...] | None = tuple(DTYPES)) -> None:
    """`--model`, and unless `dtypes` is None (a command whose config sets both) `--dtype`, one of
    `dtypes`, and `--device`: the policy a command loads."""
    group = parser.add_argument_group("policy", "the model the command loads")
    group.add_argument("--model", default=DEFAULT_MODEL, help="alias, .gguf file or model directory")
    if dtypes is not None:
        group.add_argument("--dtype", choices=dtypes, default="float32", help="policy dtype")
        group.add_argument("--device", default="auto", help="auto (CUDA when present, else CPU), cpu or cuda[:i]")


def add_common_flags(parser: argparse.ArgumentParser, out_help: str, out_required: bool = False,
                     one_dataset: bool = False, dtypes: tuple[str, ...] | None = TRAINING_DTYPES) -> None:
    """The flags of every training command: the policy (`add_policy_flags` with `dtypes`),
    `--dataset` (one problem set with `one_dataset`, else a comma-separated list), `--data-path`,
    `--out` (`out_help` says what it names) and `--seed`."""
    add_policy_flags(parser, dtypes)
    group = parser.add_argument_group("run", "the problems the command reads, where its result goes, its seed")
    if one_dataset:
        group.add_argument("--dataset", default="synthetic", choices=PROBLEM_SOURCES, help="problem set")
    else:
        group.add_argument("--dataset", default="synthetic",
                           help=f"problem set(s) to prompt with, comma-separated: {', '.join(PROBLEM_SOURCES)}")
    group.add_argument("--data-path", default=None, help="gsm8k jsonl file or folder")
    group.add_argument("--out", required=out_required, default=None, help=out_help)
    group.add_argument("--seed", type=int, default=0, help="seeds the command's random draws (samples, shuffles, "
                       "fresh weights)")
