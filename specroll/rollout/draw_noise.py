"""The noise of one draw, for samplers and drafters that read it (docs/design.md, "Drafts that read
the coming draws").

A draw is a row's uniform for one response position (`RowRandom`, float64 with 53 random bits);
everything random about the token sampled there is a function of those bits: the draw's own
uniforms for each stage of a sampler (`stage_uniform`) and one Gumbel per token id
(`token_gumbels`). A drafter that knows which draw a tree node will use can compute the same
noise, so it can draft the token the sampler will pick, not only the likeliest one; the sampler
stays exact because the noise is independent of the logits it is combined with.
"""
from __future__ import annotations

import torch

from .sampling import _as_int64, _shift_right, splitmix64

_STAGE_SALT = _as_int64(0xD6E8FEB86659FD93)
_TOKEN_SALT = _as_int64(0xA0761D6478BD642F)
_BITS = 53


def draw_bits(uniforms: torch.Tensor) -> torch.Tensor:
    """The 53 random bits (int64) of each draw in `uniforms` (float64, k / 2^53, as `RowRandom` gives)."""
    return (uniforms.double() * (1 << _BITS)).long()


def _unit(bits: torch.Tensor) -> torch.Tensor:
    """U(0, 1) in float64 from hashed int64 bits: never exactly 0 or 1, so a Gumbel is finite."""
    return (_shift_right(bits, 64 - _BITS).double() + 0.5) * (1.0 / (1 << _BITS))


def stage_uniform(uniforms: torch.Tensor, stage: int) -> torch.Tensor:
    """[...] the draw's own uniform for stage `stage` (0, 1, ...) of a sampler."""
    return _unit(splitmix64(splitmix64(draw_bits(uniforms) ^ _STAGE_SALT) + stage))


def token_gumbels(uniforms: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[..., M] float64 standard Gumbel noise of each draw in `uniforms` [...] for the token ids `tokens`
    [..., M]: the same (draw, token) always gives the same noise, distinct ones independent noise."""
    keyed = splitmix64(draw_bits(uniforms) ^ _TOKEN_SALT)[..., None]
    return -torch.log(-torch.log(_unit(splitmix64(keyed ^ splitmix64(tokens.long())))))
