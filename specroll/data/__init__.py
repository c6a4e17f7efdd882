"""Problems, prompts and rewards: what the policy is asked and how its answers are scored."""

from specroll.data.gsm8k import GSM8K_RECORDS, load_gsm8k
from specroll.data.problem_sets import DATA_SUFFIXES, load_problem_set, split_file
from specroll.data.problems import Problem
from specroll.data.prompt_stream import PromptStream
from specroll.data.prompts import BOXED_INSTRUCTION, INSTRUCTION, format_prompt
from specroll.data.records import ANSWER_FORMATS, NUMERIC_FORMATS, RecordFormat, strip_calculator_annotations
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
    "ANSWER_FORMATS",
    "BOXED_INSTRUCTION",
    "DATA_SUFFIXES",
    "GSM8K_RECORDS",
    "INSTRUCTION",
    "MathVerifier",
    "NUMERIC_FORMATS",
    "OPERATIONS",
    "PROBLEM_SOURCES",
    "Problem",
    "PromptStream",
    "REWARD_FUNCTIONS",
    "RecordFormat",
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
    "load_problem_set",
    "load_problems",
    "math_reward",
    "score_response",
    "score_responses",
    "split_file",
    "strip_calculator_annotations",
]
