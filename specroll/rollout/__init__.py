"""Batched rollout generation with the one sampling function of SpecRoll."""
from .engine import DecodeState, PlainDecoder, RolloutEngine, RolloutOutput, StepResult
from .sampling import RowRandom, SamplingParams, row_uniforms, sample_tokens, sampling_logprobs, splitmix64

__all__ = [
    "DecodeState",
    "PlainDecoder",
    "RolloutEngine",
    "RolloutOutput",
    "RowRandom",
    "SamplingParams",
    "StepResult",
    "row_uniforms",
    "sample_tokens",
    "sampling_logprobs",
    "splitmix64",
]
