"""Checks of config fields, each written once: every config dataclass validates its fields with these.

A failed check raises `FieldError`, whose one format is `<field> must be <allowed>, got <given>`
(then `: <why>` where a reason helps). A config names its own fields; where it sits inside the
run's config, `specroll.configs.build_dataclass` prepends its dotted path (`FieldError.within`),
so the user reads `rollout.speculation.max_nodes must be ...`.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

DEVICES = "'auto', 'cpu' or 'cuda[:i]'"
# Local paths as `specroll.data.load_problem_set` tells them from dataset (and hub model) names.
LOCAL_PREFIXES = ("/", ".", "~")


class FieldError(ValueError):
    """A config field holds a value its config does not allow."""

    def __init__(self, field: str, given: Any, allowed: str, why: str = "") -> None:
        super().__init__(field, given, allowed, why)  # the args rebuild it when pickled (Ray)
        self.field, self.given, self.allowed, self.why = field, given, allowed, why

    def __str__(self) -> str:
        return f"{self.field} must be {self.allowed}, got {self.given!r}" + (f": {self.why}" if self.why else "")

    def within(self, path: str) -> "FieldError":
        """The same error named from the config `path` (a dotted path) that holds this field's config."""
        return FieldError(f"{path}.{self.field}" if path else self.field, self.given, self.allowed, self.why)


def require(ok: bool, field: str, given: Any, allowed: str, why: str = "") -> None:
    """A rule of the config's own (across its fields, say): `FieldError` unless `ok`."""
    if not ok:
        raise FieldError(field, given, allowed, why)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    """'>= 0', '> 0', '<= 1', 'in [0, 1)', or '' for no bound."""
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high}"
    return ""


def within_bounds(value: float, low: float | None, high: float | None, low_open: bool, high_open: bool) -> bool:
    above = low is None or value > low or (value == low and not low_open)
    below = high is None or value < high or (value == high and not high_open)
    return above and below


def check_int(field: str, value: Any, low: int | None = None, high: int | None = None, why: str = "") -> None:
    """An int (not a bool) in [low, high]; a bound left None is open."""
    if not (is_int(value) and within_bounds(value, low, high, False, False)):
        raise FieldError(field, value, " ".join(filter(None, ("an int", interval(low, high, False, False)))), why)


def check_number(field: str, value: Any, low: float | None = None, high: float | None = None, *,
                 low_open: bool = False, high_open: bool = False, why: str = "") -> None:
    """A finite number (an int or a float, not a bool) within the bounds; a bound left None is open."""
    bounds = interval(low, high, low_open, high_open)
    if not (is_number(value) and math.isfinite(value) and within_bounds(value, low, high, low_open, high_open)):
        raise FieldError(field, value, " ".join(filter(None, ("a finite number", bounds))), why)


def check_positive(field: str, value: Any) -> None:
    """A finite number > 0 (rates, timeouts, sizes)."""
    check_number(field, value, 0, low_open=True)


def check_probability(field: str, value: Any, *, low_open: bool = False, high_open: bool = False) -> None:
    """A number in [0, 1], either end open as asked (momentums in [0, 1), fractions in (0, 1))."""
    check_number(field, value, 0, 1, low_open=low_open, high_open=high_open)


def check_bool(field: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise FieldError(field, value, "a bool")


def check_choice(field: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise FieldError(field, value, f"one of {', '.join(map(repr, choices))}")


def check_text(field: str, value: Any, optional: bool = False) -> None:
    """A non-empty string (a name or a path); with `optional`, None too."""
    if not (isinstance(value, str) and value) and not (optional and value is None):
        raise FieldError(field, value, "null or a non-empty string" if optional else "a non-empty string")


def check_device(field: str, value: Any) -> None:
    """'auto' (CUDA when present, else CPU), 'cpu' or 'cuda[:i]'."""
    if not isinstance(value, str) or (value != "auto" and value.split(":")[0] not in ("cpu", "cuda")):
        raise FieldError(field, value, DEVICES)


def check_seed(field: str, value: Any) -> None:
    """Any int: seeds may be negative or large."""
    check_int(field, value)


def not_found(path: str) -> str:
    """The `why` of a path that names no file here: the path as read, where `~` made it another."""
    local = Path(path).expanduser()
    return "not found" if str(local) == path else f"{local} not found"


def names_local_file(path: str, suffixes: tuple[str, ...]) -> bool:
    """Whether `path` names a local file (by its start or its suffix) rather than a hub name."""
    return path.startswith(LOCAL_PREFIXES) or path.endswith(suffixes)
