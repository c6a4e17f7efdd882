"""Answer extraction and the number reward for math responses.

Everything here is a pure function of strings, and every parser runs in time linear in the
length of the text, so a hostile response cannot stall scoring. Answers are compared as
exact rationals (``fractions.Fraction``) so ``"3.50"``, ``"7/2"`` and ``"\\frac{7}{2}"`` agree
and a 40-digit answer never goes through a float.
"""

from __future__ import annotations

import re
import unicodedata
from bisect import bisect_left
from fractions import Fraction

# Non-ASCII look-alikes that models (and some datasets) emit inside numbers.
_PUNCTUATION = str.maketrans(
    {
        "\u2212": "-",  # minus sign
        "\uff0d": "-",  # fullwidth hyphen-minus
        "\uff0b": "+",
        "\uff0c": ",",
        "\uff0e": ".",
        "\u066b": ".",  # Arabic decimal separator
        "\u066c": ",",  # Arabic thousands separator
        "\uff04": "$",
        "\uff0f": "/",
        "\u2044": "/",  # fraction slash
    }
)

_LATEX_FRACTION = re.compile(
    r"\\[dt]?frac\s*\{\s*(\d[\d,]*(?:\.\d+)?)\s*\}\s*\{\s*(\d+)\s*\}"
)
# LaTeX thousands separators: 1{,}234 and 1\,234.
_LATEX_THOUSANDS = re.compile(r"\{,\}|(?<=\d)\\,(?=\d{3})")

_NUMBER = re.compile(
    r"""
    # A sign right after an operand ("5-3") is a binary minus, not part of the number.
    (?:(?<![\w)\]}])(?P<sign>[-+]))?
    (?:[$€£¥₹]\s?(?P<sign_after_currency>[-+])?)?
    (?P<integer>\d{1,3}(?:,\d{3})+(?!\d)|\d+|(?=\.\d))
    (?:\.(?P<decimals>\d+))?
    (?:/(?P<denominator>0*[1-9]\d*))?
    """,
    re.VERBOSE,
)

# What follows a marker, up to the end of its line or the next marker.
_MARKER = re.compile(r"####((?:(?!####)[^\n])*)")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")


def _normalise_text(text: str) -> str:
    """Rewrite unicode digits, look-alike punctuation and LaTeX number markup as ASCII."""
    if not text.isascii():
        text = "".join(
            str(unicodedata.decimal(char)) if char.isdecimal() and not char.isascii() else char
            for char in text
        )
    text = text.translate(_PUNCTUATION)
    text = _LATEX_FRACTION.sub(r"\1/\2", text)
    return _LATEX_THOUSANDS.sub(",", text)


def _canonical(match: re.Match[str]) -> str:
    """Canonical string of a matched number: no commas, no redundant zeros, reduced fraction."""
    signs = (match["sign"] or "") + (match["sign_after_currency"] or "")
    number = match["integer"].replace(",", "").lstrip("0") or "0"
    decimals = (match["decimals"] or "").rstrip("0")
    if decimals:
        number = f"{number}.{decimals}"
    if match["denominator"]:
        denominator = match["denominator"].lstrip("0")
        try:
            number = str(Fraction(number) / int(denominator))
        except ValueError:
            # Beyond Python's int-string digit limit: keep the literal fraction unreduced.
            number = f"{number}/{denominator}"
    if number == "0" or "-" not in signs:
        return number
    return f"-{number}"


def _first_number(text: str) -> str | None:
    """Canonical form of the first number in ``text``, or None."""
    match = _NUMBER.search(text)
    return _canonical(match) if match else None


def _boxed_spans(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of the contents of every balanced ``\\boxed{...}``, in the order the boxes open.

    One pass over the braces with a stack of the open ones, so unbalanced or deeply nested
    boxes cost time linear in the length of ``text``.
    """
    box_braces = {opening.end() - 1 for opening in _BOXED.finditer(text)}
    open_braces, spans = [], []
    for brace in _BRACE.finditer(text):
        position = brace.start()
        if text[position] == "{":
            open_braces.append(position)
        elif open_braces:
            start = open_braces.pop()
            if start in box_braces:
                spans.append((start + 1, position))
    return sorted(spans)


def last_boxed(text: str) -> str | None:
    """The contents of the last balanced ``\\boxed{...}`` (or ``\\fbox``) of ``text``, or None."""
    spans = _boxed_spans(text)
    return text[spans[-1][0] : spans[-1][1]] if spans else None


def extract_answer(text: str) -> str | None:
    """Extract the final numeric answer of a response, in canonical form.

    Priority: the number after the last ``####`` marker that has one; else the number in the
    last ``\\boxed{...}`` that has one; else the last number in the text. Canonical form drops
    thousands commas, currency, percent signs, a leading ``+``, trailing zeros of decimals and
    reduces fractions (``"$1,234.50"`` -> ``"1234.5"``, ``"\\frac{14}{4}"`` -> ``"7/2"``);
    unicode decimal digits become ASCII. Returns None when the text holds no number.
    """
    text = _normalise_text(text)
    for marker in reversed(list(_MARKER.finditer(text))):
        number = _first_number(marker.group(1))
        if number is not None:
            return number
    # A number never holds a brace, so the first number of a box is the first match inside it.
    numbers = list(_NUMBER.finditer(text))
    starts = [number.start() for number in numbers]
    for start, end in reversed(_boxed_spans(text)):
        index = bisect_left(starts, start)
        if index < len(numbers) and numbers[index].end() <= end:
            return _canonical(numbers[index])
    return _canonical(numbers[-1]) if numbers else None


def answers_match(predicted: str | None, gold: str) -> bool:
    """Whether two answers are the same number; never raises.

    Both sides go through :func:`extract_answer`, so a gold of ``"1,234"`` matches a
    prediction of ``"1234"``, and ``"3.50"``, ``"7/2"`` and ``"3.5"`` all match each other.
    """
    if predicted is None or gold is None:
        return False
    predicted, gold = extract_answer(str(predicted)), extract_answer(str(gold))
    if predicted is None or gold is None:
        return False
    if predicted == gold:
        return True
    try:
        return Fraction(predicted) == Fraction(gold)
    except (ValueError, ZeroDivisionError):
        # Numbers past Python's int-string digit limit: their canonical strings differ.
        return False


def math_reward(response: str, gold: str) -> float:
    """1.0 when the answer extracted from ``response`` equals ``gold``, else 0.0."""
    return 1.0 if answers_match(extract_answer(response), gold) else 0.0


def format_reward(response: str) -> float:
    """1.0 when the response's last non-blank line is ``#### <number>``, else 0.0."""
    last_line = _normalise_text(response).rstrip().rpartition("\n")[2].lstrip(" \t")
    if not last_line.startswith("####"):
        return 0.0
    return 1.0 if _NUMBER.fullmatch(last_line[4:].lstrip(" \t")) else 0.0


def boxed_format_reward(response: str) -> float:
    """1.0 when the response holds a balanced ``\\boxed{...}``, else 0.0."""
    return 1.0 if _boxed_spans(response) else 0.0
