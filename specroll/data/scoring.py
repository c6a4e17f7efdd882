"""Scoring responses against gold answers with the reward function a problem set chooses."""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

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
        if self.function not in REWARD_FUNCTIONS:
            raise ValueError(f"RewardConfig.function must be one of {', '.join(map(repr, REWARD_FUNCTIONS))}, "
                             f"got {self.function!r}")
        if self.function == "math_verify" and importlib.util.find_spec("math_verify") is None:
            raise ValueError("RewardConfig.function 'math_verify' needs the math-verify package: "
                             "pip install math-verify")
        for field_name in ("correct", "format_weight", "timeout_s"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"RewardConfig.{field_name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"RewardConfig.{field_name} must be finite and >= 0, got {value!r}")
        if self.timeout_s == 0:
            raise ValueError("RewardConfig.timeout_s must be > 0")


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
