"""Batched rollout generation with the one sampling function of SpecRoll."""
from .engine import DecodeState, PlainDecoder, RolloutEngine, RolloutOutput, StepResult
from .sampling import SamplingParams, gumbel_noise, row_generator, sample_tokens, sampling_logprobs

__all__ = [
    "DecodeState",
    "PlainDecoder",
    "RolloutEngine",
    "RolloutOutput",
    "SamplingParams",
    "StepResult",
    "gumbel_noise",
    "row_generator",
    "sample_tokens",
    "sampling_logprobs",
]
