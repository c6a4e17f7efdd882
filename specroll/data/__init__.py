"""Problems, prompts and rewards: what the policy is asked and how its answers are scored."""

from specroll.data.gsm8k import load_gsm8k, strip_calculator_annotations
from specroll.data.problems import Problem
from specroll.data.prompt_stream import PromptStream
from specroll.data.prompts import INSTRUCTION, format_prompt
from specroll.data.rewards import (
    RewardConfig,
    answers_match,
    extract_answer,
    format_reward,
    math_reward,
    score_response,
)
from specroll.data.sources import PROBLEM_SOURCES, load_problems
from specroll.data.synthetic import OPERATIONS, SyntheticConfig, generate_synthetic

__all__ = [
    "INSTRUCTION",
    "OPERATIONS",
    "PROBLEM_SOURCES",
    "Problem",
    "PromptStream",
    "RewardConfig",
    "SyntheticConfig",
    "answers_match",
    "extract_answer",
    "format_prompt",
    "format_reward",
    "generate_synthetic",
    "load_gsm8k",
    "load_problems",
    "math_reward",
    "score_response",
    "strip_calculator_annotations",
]
