"""Answer extraction and rewards against hand-written responses, adversarial ones included."""

import math
import time

import pytest

from specroll.data import (
    RewardConfig,
    answers_match,
    boxed_format_reward,
    extract_answer,
    format_reward,
    last_boxed,
    math_reward,
    score_response,
)

HUGE = str(10**40)  # 41 digits: far beyond float precision
BEYOND_INT_LIMIT = "9" * 5000  # past Python's default 4300-digit int-string limit


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", None),
        ("I cannot solve this.", None),
        ("#### no number here", None),
        ("She has 3 apples and 5 pears, so 8 fruits in all.", "8"),
        ("The answer is 12.", "12"),
        ("#### 42\nWait, maybe it is 7 or 9.", "42"),
        ("First guess #### 3, final #### 5", "5"),
        ("#### 5\n#### \nThe last marker has no number.", "5"),
        ("####\nThe answer is 4", "4"),
        ("So the answer is \\boxed{18}, not 20.", "18"),
        ("\\boxed{1} then \\boxed{\\text{total } {2}} then 99", "2"),
        ("\\boxed{\\frac{7}{2}}", "7/2"),
        ("x = \\dfrac{14}{4}", "7/2"),
        ("\\boxed{1{,}234}", "1234"),
        ("\\boxed{unclosed 5", "5"),
        ("\\boxed{\\boxed{3} and 4}", "3"),
        ("} \\boxed{x {y} 6} \\boxed{ {} }", "6"),
        ("\\boxed{" * 50 + "8", "8"),
        ("#### 7/2", "7/2"),
        ("#### 8/4", "2"),
        ("#### " + HUGE, HUGE),
        ("#### " + BEYOND_INT_LIMIT, BEYOND_INT_LIMIT),
        ("الجواب هو ٤٢", "42"),
        ("答えは４２です", "42"),
        ("#### ١٬٢٣٤٫٥", "1234.5"),
        ("The total is 1,234,567 people.", "1234567"),
        ("It costs $5.", "5"),
        ("It costs €5", "5"),
        ("It costs 5 dollars", "5"),
        ("Prices rose by 50%", "50"),
        ("#### +7", "7"),
        ("The temperature is -3 degrees", "-3"),
        ("x = −3", "-3"),
        ("#### -$4.00", "-4"),
        ("#### $-4", "-4"),
        ("#### -0", "0"),
        ("5-3", "3"),
        ("#### 3.50", "3.5"),
        ("#### 007", "7"),
        ("It is .5 of the cake", "0.5"),
        ("#### 1,450,000", "1450000"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("predicted", "gold", "expected"),
    [
        ("3.50", "7/2", True),
        ("3.5", "3.50", True),
        ("\\frac{7}{2}", "3.5", True),
        ("0.1", "1/10", True),
        ("1234", "1,234", True),
        ("-3", "-3.0", True),
        ("5", "6", False),
        ("-5", "5", False),
        (None, "5", False),
        ("five", "5", False),
        ("5", "", False),
        (HUGE, HUGE, True),
        (HUGE, str(10**40 + 1), False),
        (BEYOND_INT_LIMIT, BEYOND_INT_LIMIT, True),
        (BEYOND_INT_LIMIT, "1" + BEYOND_INT_LIMIT, False),
        (BEYOND_INT_LIMIT + "/7", "3", False),
    ],
)
def test_answers_match(predicted, gold, expected):
    assert answers_match(predicted, gold) is expected


@pytest.mark.parametrize(
    ("response", "gold", "expected"),
    [
        ("9 * 2 = 18 dollars.\n#### 18", "18", 1.0),
        ("9 * 2 = 18 dollars.\n#### 18", "19", 0.0),
        ("The answer is \\boxed{18}.", "18", 1.0),
        ("I think it's $1,234.", "1234", 1.0),
        ("", "18", 0.0),
    ],
)
def test_math_reward(response, gold, expected):
    assert math_reward(response, gold) == expected


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("Step one.\n#### 18", 1.0),
        ("#### 18", 1.0),
        ("Step one.\n#### -3.5  \n\n", 1.0),
        ("Step one.\n#### $1,234", 1.0),
        ("Step one.\n#### 18\nBut let me double-check.", 0.0),
        ("The answer is #### 18", 0.0),
        ("Step one.\n#### eighteen", 0.0),
        ("Step one.\n#### 18 apples", 0.0),
        ("The answer is 18", 0.0),
        ("", 0.0),
    ],
)
def test_format_reward(response, expected):
    assert format_reward(response) == expected


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("So 9 * 2 = 18.\n#### 18", 1.5),  # correct and formatted
        ("So the answer is \\boxed{18}", 1.0),  # correct only
        ("So 9 * 2 = 17.\n#### 17", 0.5),  # formatted only
        ("No idea.", 0.0),
    ],
)
def test_score_response_adds_weighted_format_bonus(response, expected):
    assert score_response(response, "18", RewardConfig(correct=1.0, format_weight=0.5)) == expected


def test_default_reward_config_scores_correctness_only():
    assert score_response("#### 18", "18", RewardConfig()) == 1.0
    assert score_response("#### 17", "18", RewardConfig()) == 0.0


@pytest.mark.parametrize(
    ("field", "value"),
    [("correct", -1.0), ("correct", math.nan), ("format_weight", math.inf), ("format_weight", "1")],
)
def test_reward_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        RewardConfig(**{field: value})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("So \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{2} or \\fbox{ [1, 2) }", " [1, 2) "),
        ("\\boxed{outer \\boxed{inner}}", "inner"),
        ("\\boxed{1} and \\boxed{unclosed", "1"),
        ("no box", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected
    assert boxed_format_reward(text) == (0.0 if expected is None else 1.0)


# 100,000 characters each, built to make a parser that rescans the text from every opening
# brace, marker or line quadratic.
ADVERSARIAL = {
    "unbalanced boxes": "\\boxed{" * 14_286,
    "nested boxes": "\\boxed{" * 12_500 + "7" + "}" * 12_500,
    "open braces": "\\boxed{" + "{" * 100_000,
    "marker then blanks": "\n####" + " " * 100_000 + "x",
    "markers without numbers": "#### x\n" * 14_286,
    "fractions": "\\frac{" * 16_667,
    "digits": "9" * 100_000,
}


@pytest.mark.parametrize("name", ADVERSARIAL)
def test_reward_is_linear_in_the_response_length(name):
    started = time.perf_counter()
    score_response(ADVERSARIAL[name], "7", RewardConfig(format_weight=1.0))
    elapsed = time.perf_counter() - started
    print(f"{name}: {elapsed * 1e3:.1f} ms for {len(ADVERSARIAL[name])} characters")
    # Milliseconds for a linear parser, with room for a loaded CI machine; minutes for a quadratic one.
    assert elapsed < 5.0
