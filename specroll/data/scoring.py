"""Scoring responses against gold answers with the reward function a problem set chooses."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from specroll.config_checks import check_choice, check_number, check_positive, require
from specroll.data.rewards import boxed_format_reward, format_reward, math_reward
from specroll.data.verifier import MathVerifier

REWARD_FUNCTIONS: tuple[str, ...] = ("number", "math_verify")


@dataclass(frozen=True)
class RewardConfig:
    """How responses are scored.

    Attributes:
        function: ``"number"`` compares final numbers exactly (GSM8K, synthetic problems);
            ``"math_verify"`` compares LaTeX answers as expressions through math-verify (MATH,
            DAPO), so ``\\frac{1}{2}`` equals ``0.5`` and ``\\sqrt{8}`` equals ``2\\sqrt{2}``.
        correct: reward for a correct final answer.
        format_weight: bonus for the answer format the function reads (a last ``#### <number>``
            line for number, a ``\\boxed{...}`` for math_verify); 0 disables it.
        timeout_s: longest math_verify may check one response; past it the response counts as wrong.
    """

    function: str = "number"
    correct: float = 1.0
    format_weight: float = 0.0
    timeout_s: float = 2.0

    def __post_init__(self) -> None:
        check_choice("function", self.function, REWARD_FUNCTIONS)
        require(self.function != "math_verify" or importlib.util.find_spec("math_verify") is not None, "function",
                self.function, "'number' here", why="math_verify needs the math-verify package: pip install math-verify")
        check_number("correct", self.correct, 0)
        check_number("format_weight", self.format_weight, 0)
        check_positive("timeout_s", self.timeout_s)


class Score(NamedTuple):
    """The score of one response."""

    reward: float  # correct * RewardConfig.correct + format * RewardConfig.format_weight
    correct: bool  # whether the final answer equals the gold one


@functools.cache
def shared_verifier(timeout_s: float) -> MathVerifier:
    """This process's math-verify verifier for ``timeout_s``: its worker starts once, not per call."""
    return MathVerifier(timeout_s)


def score_responses(responses: Sequence[str], golds: Sequence[str], cfg: RewardConfig) -> list[Score]:
    """The score of each response against its gold answer, with ``cfg.function``."""
    if len(responses) != len(golds):
        raise ValueError(f"need one gold answer per response, got {len(responses)} responses and {len(golds)}")
    if cfg.function == "math_verify":
        correct = shared_verifier(cfg.timeout_s).check(golds, responses)
        formats = [boxed_format_reward(response) for response in responses]
    else:
        correct = [math_reward(response, gold) == 1.0 for response, gold in zip(responses, golds)]
        formats = [format_reward(response) for response in responses]
    return [Score(cfg.correct * ok + cfg.format_weight * form, ok) for ok, form in zip(correct, formats)]


def score_response(response: str, gold: str, cfg: RewardConfig) -> float:
    """The reward of one response: ``correct * is_correct + format_weight * format``."""
    return score_responses([response], [gold], cfg)[0].reward
