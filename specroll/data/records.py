"""How one record of a problem set becomes a Problem: which fields, which answer format, which levels."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from specroll.config_checks import check_choice, check_int, check_text
from specroll.data.problems import Problem
from specroll.data.rewards import extract_answer, last_boxed

# number: the final number of the answer field (as the number reward reads a response);
# gsm8k: the number of its "#### n" line; boxed: its last \boxed{}; plain: the field is the answer.
ANSWER_FORMATS: tuple[str, ...] = ("number", "gsm8k", "boxed", "plain")
# The formats whose answers are canonical numbers, which the number reward compares.
NUMERIC_FORMATS: tuple[str, ...] = ("number", "gsm8k")

_CALCULATOR_ANNOTATION = re.compile(r"<<[^<>]*>>")
_LEVEL_NUMBER = re.compile(r"\d+")


@dataclass(frozen=True)
class RecordFormat:
    """Where a record keeps its question and answer, and how the answer is written.

    Attributes:
        question: the field of the question: a string, or a chat message list (``[{"role",
            "content"}, ...]``) whose last user message is the question. ``a.b`` reads the
            field ``b`` of the nested record ``a``.
        answer: the field of the gold answer, or of the worked solution that holds it; dotted too.
        answer_format: how the answer field is written, one of :data:`ANSWER_FORMATS`.
        level_field: the field of a record's difficulty level (``"Level 3"`` or ``3``).
        levels: keep only records at these levels; empty keeps every record.
    """

    question: str = "question"
    answer: str = "answer"
    answer_format: str = "gsm8k"
    level_field: str = "level"
    levels: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Hydra hands over lists; a tuple keeps the frozen config hashable.
        object.__setattr__(self, "levels", tuple(self.levels))
        for field_name in ("question", "answer", "level_field"):
            check_text(field_name, getattr(self, field_name))
        check_choice("answer_format", self.answer_format, ANSWER_FORMATS)
        for i, level in enumerate(self.levels):
            check_int(f"levels[{i}]", level)


def strip_calculator_annotations(text: str) -> str:
    """Remove GSM8K calculator annotations: ``"48/2 = <<48/2=24>>24"`` -> ``"48/2 = 24"``."""
    return _CALCULATOR_ANNOTATION.sub("", text)


def field_value(record: Mapping, dotted: str) -> object:
    """The value at ``dotted`` (``"reward_model.ground_truth"``) in a nested record; None when absent."""
    value: object = record
    for key in dotted.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def question_text(value: object, field: str) -> str:
    """The question a field holds: a string, or the content of a chat list's last user message."""
    if isinstance(value, list):
        users = [m.get("content") for m in value if isinstance(m, Mapping) and m.get("role") == "user"]
        value = users[-1] if users else None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"missing or non-string field {field!r} (a string or a chat list with a user message)")
    return value.strip()


def gold_answer(value: object, fmt: RecordFormat) -> tuple[str, str]:
    """``(answer, solution)`` of an answer field written in ``fmt.answer_format``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"missing or non-string field {fmt.answer!r}")
    solution = value.strip()
    if fmt.answer_format == "gsm8k":
        # The annotations are calculator-tool markup the policy never produces at rollout time.
        solution = strip_calculator_annotations(solution).strip()
        _, marker, final = solution.rpartition("####")
        answer = extract_answer(final) if marker else None
        expected = "end with a '#### <number>' line"
    elif fmt.answer_format == "number":
        answer, expected = extract_answer(solution), "hold a number"
    elif fmt.answer_format == "boxed":
        answer, expected = last_boxed(solution), "hold a \\boxed{...} answer"
        answer = answer.strip() if answer and answer.strip() else None
    else:
        answer, expected = solution, ""
    if answer is None:
        raise ValueError(f"field {fmt.answer!r} does not {expected}")
    return answer, solution


def record_level(record: Mapping, fmt: RecordFormat) -> int | None:
    """The level of a record (``"Level 3"`` -> 3); None when it has none (MATH's ``"Level ?"``)."""
    value = field_value(record, fmt.level_field)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    found = _LEVEL_NUMBER.search(value) if isinstance(value, str) else None
    return int(found.group()) if found else None


def problem_from_record(record: Mapping, fmt: RecordFormat) -> Problem | None:
    """The Problem of one record; None when ``fmt.levels`` leaves its level out.

    Raises:
        ValueError: a missing or malformed question or answer, saying which field.
    """
    if fmt.levels and record_level(record, fmt) not in fmt.levels:
        return None
    question = question_text(field_value(record, fmt.question), fmt.question)
    answer, solution = gold_answer(field_value(record, fmt.answer), fmt)
    return Problem(question=question, answer=answer, solution=solution)
