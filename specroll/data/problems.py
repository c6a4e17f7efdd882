"""The problem record every data source produces and every consumer reads."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Problem:
    """One math problem.

    Attributes:
        question: the problem statement shown to the policy.
        answer: the gold answer: a canonical number such as ``"42"``, ``"-3.5"`` or ``"7/2"``
            (GSM8K, synthetic), or a LaTeX expression such as ``"\\frac{\\sqrt{3}}{2}"`` (MATH, DAPO).
        solution: a worked solution holding the answer (``#### <answer>`` or ``\\boxed{...}``), or
            the answer itself when the record has none.
        source: where the problem was read ("train.jsonl:12", "data.parquet record 3", a hub row),
            for messages about it; empty where it was generated. Not part of its identity.
    """

    question: str
    answer: str
    solution: str
    source: str = field(default="", compare=False)


def take_first(problems: list[Problem], limit: int | None) -> list[Problem]:
    """Return the first ``limit`` problems, or all of them when ``limit`` is None."""
    if limit is None:
        return problems
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    return problems[:limit]
