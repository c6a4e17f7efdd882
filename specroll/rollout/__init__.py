"""Batched rollout generation with the one sampling function of SpecRoll."""
from .decode_state import DecodeState, StepResult
from .decoder import Decoder
from .engine import RolloutEngine, RolloutOutput
from .plain_decoder import PlainDecoder
from .samplers import sample_tokens
from .sampling import SAMPLERS, RowRandom, SamplingParams, row_uniforms, sampling_logprobs, splitmix64
from .stats import CompileStats, DecoderStats, GenerationStats, ReflexStats, TreeStats

__all__ = [
    "CompileStats",
    "DecodeState",
    "Decoder",
    "DecoderStats",
    "GenerationStats",
    "PlainDecoder",
    "ReflexStats",
    "RolloutEngine",
    "RolloutOutput",
    "RowRandom",
    "SAMPLERS",
    "SamplingParams",
    "StepResult",
    "TreeStats",
    "row_uniforms",
    "sample_tokens",
    "sampling_logprobs",
    "splitmix64",
]
