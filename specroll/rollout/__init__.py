"""Batched rollout generation with the one sampling function of SpecRoll."""
from .engine import DecodeState, PlainDecoder, RolloutEngine, RolloutOutput, StepResult
from .sampling import SamplingParams, row_generator, sample_tokens, sampling_logprobs, uniform_draws

__all__ = [
    "DecodeState",
    "PlainDecoder",
    "RolloutEngine",
    "RolloutOutput",
    "SamplingParams",
    "StepResult",
    "row_generator",
    "sample_tokens",
    "sampling_logprobs",
    "uniform_draws",
]
