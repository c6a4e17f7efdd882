"""Problems, prompts and rewards: what the policy is asked and how its answers are scored."""

from specroll.data.gsm8k import load_gsm8k, strip_calculator_annotations
from specroll.data.problems import Problem
from specroll.data.prompt_stream import PromptStream
from specroll.data.prompts import INSTRUCTION, format_prompt
from specroll.data.rewards import (
    answers_match,
    boxed_format_reward,
    extract_answer,
    format_reward,
    last_boxed,
    math_reward,
)
from specroll.data.scoring import REWARD_FUNCTIONS, RewardConfig, Score, score_response, score_responses
from specroll.data.sources import PROBLEM_SOURCES, load_problems
from specroll.data.synthetic import OPERATIONS, SyntheticConfig, generate_synthetic
from specroll.data.verifier import MathVerifier

__all__ = [
    "INSTRUCTION",
    "MathVerifier",
    "OPERATIONS",
    "PROBLEM_SOURCES",
    "Problem",
    "PromptStream",
    "REWARD_FUNCTIONS",
    "RewardConfig",
    "Score",
    "SyntheticConfig",
    "answers_match",
    "boxed_format_reward",
    "extract_answer",
    "format_prompt",
    "format_reward",
    "generate_synthetic",
    "last_boxed",
    "load_gsm8k",
    "load_problems",
    "math_reward",
    "score_response",
    "score_responses",
    "strip_calculator_annotations",
]
