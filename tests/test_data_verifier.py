"""The math-verify reward: equivalent LaTeX answers are accepted and others rejected (the cases
that break string matching), each response's check is time-bounded from any thread, and a stuck
worker is replaced."""

import os
import re
import signal
import threading
import time

import pytest

from specroll.data import MathVerifier, RewardConfig, Score, score_response, score_responses

TIMEOUT_S = 1.0
# sympy evaluates the tower 9^(9^(9^9)) for far longer than any time limit.
POWER_TOWER = "The answer is \\boxed{9^{9^{9^{9}}}}."


@pytest.fixture(scope="module")
def verifier():
    verifier = MathVerifier(timeout_s=TIMEOUT_S)
    yield verifier
    verifier.close()


EQUIVALENT = [
    ("\\frac{1}{2}", "So the answer is \\boxed{0.5}."),
    ("0.5", "So the answer is \\boxed{\\frac{1}{2}}."),
    ("\\frac{1}{2}", "Half of it: \\boxed{\\dfrac12}"),
    ("\\sqrt{8}", "Simplified, \\boxed{2\\sqrt{2}}."),
    ("2\\sqrt{2}", "It is \\boxed{\\sqrt{8}}."),
    ("[1, 2)", "The set is \\boxed{[1,2)}."),
    ("(-\\infty, 3]", "So $x \\in \\boxed{(-\\infty,3]}$."),
    ("12\\text{ cm}", "The perimeter is \\boxed{12}."),
    ("5", "The length is \\boxed{5 \\text{ cm}}."),
    ("x^2+2x+1", "Expanding nothing: \\boxed{(x+1)^2}"),
    ("2, 3", "The roots are \\boxed{2} and \\boxed{3}."),
    ("2, 3", "The roots are \\boxed{3, 2}."),
    ("72", "48 + 24 = 72\n#### 72"),  # a GSM8K-style number gold
    ("9", "So there are 9 divisors.\nAnswer: 9"),  # DAPO's own answer line
]
DIFFERENT = [
    ("\\frac{1}{2}", "So the answer is \\boxed{\\frac{1}{3}}."),
    ("\\sqrt{8}", "It is \\boxed{2\\sqrt{3}}."),
    ("[1, 2)", "The set is \\boxed{(1,2)}."),
    ("[1, 2)", "The set is \\boxed{[1,2]}."),
    ("5", "The length is \\boxed{6 \\text{ cm}}."),
    ("2, 3", "The root is \\boxed{2}."),
    ("3", "Maybe \\boxed{2}, or rather \\boxed{3}."),  # boxing several candidates earns nothing
    ("3", "I cannot solve this."),
    ("3", ""),
]


def test_equivalent_answers_are_accepted_and_others_rejected(verifier):
    golds, responses = zip(*EQUIVALENT)
    assert verifier.check(golds, responses) == [True] * len(EQUIVALENT)
    golds, responses = zip(*DIFFERENT)
    assert verifier.check(golds, responses) == [False] * len(DIFFERENT)
    assert verifier.timed_out == 0


def test_each_response_is_time_bounded_even_off_the_main_thread(verifier):
    results, elapsed = {}, {}

    def check():
        started = time.perf_counter()
        results["value"] = verifier.check(["1", "\\frac{1}{2}"], [POWER_TOWER, "\\boxed{0.5}"])
        elapsed["s"] = time.perf_counter() - started

    before = verifier.timed_out
    worker = threading.Thread(target=check)
    worker.start()
    worker.join(timeout=60)
    print(f"power tower stopped after {elapsed['s']:.2f} s (limit {TIMEOUT_S} s)")
    assert results["value"] == [False, True]  # the slow one counts as wrong; the worker goes on
    assert verifier.timed_out == before + 1
    assert elapsed["s"] < TIMEOUT_S + 3.0


def test_a_worker_that_stops_answering_is_replaced(verifier):
    verifier.check(["1"], ["\\boxed{1}"])
    stuck = verifier._process
    os.kill(stuck.pid, signal.SIGSTOP)  # as if stuck in C code that no timer interrupts
    before = verifier.timed_out
    assert verifier.check(["1", "2"], ["\\boxed{1}", "\\boxed{2}"]) == [False, True]
    assert verifier.timed_out == before + 1
    assert stuck.poll() is not None and verifier._process is not stuck


def test_math_verify_reward_function_scores_and_formats():
    cfg = RewardConfig(function="math_verify", correct=1.0, format_weight=0.5, timeout_s=TIMEOUT_S)
    responses = ["\\boxed{2\\sqrt{2}}", "It is $\\sqrt{8}$", "\\boxed{3}", "It is 3"]
    assert score_responses(responses, ["\\sqrt{8}"] * 4, cfg) == [Score(1.5, True), Score(1.0, True),
                                                                   Score(0.5, False), Score(0.0, False)]
    assert score_response("\\boxed{0.5}", "\\frac{1}{2}", cfg) == 1.5


def test_number_reward_function_compares_numbers_only():
    cfg = RewardConfig(function="number")
    # The number reward reads 2 and 8; only math_verify knows these are equal.
    assert score_responses(["\\boxed{2\\sqrt{2}}", "#### 0.5"], ["\\sqrt{8}", "1/2"], cfg) == [Score(0.0, False),
                                                                                              Score(1.0, True)]


@pytest.mark.parametrize(("field", "value", "message"),
                         [("function", "exact", "function must be one of 'number', 'math_verify', got 'exact'"),
                          ("timeout_s", 0.0, "timeout_s must be a finite number > 0, got 0.0"),
                          ("timeout_s", float("inf"), "timeout_s must be a finite number > 0, got inf")])
def test_reward_config_rejects_bad_values(field, value, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        RewardConfig(**{field: value})
