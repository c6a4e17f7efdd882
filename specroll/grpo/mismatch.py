"""Importance weights that correct the rollout-learner mismatch (truncated or masked IS).

The sampler and the learner compute slightly different log-probabilities for the same tokens
(other kernels, bf16), so the tokens were drawn from ``pi_sampler``, not from the learner's
``pi_old``. Weighting each token's loss by ``w = pi_old / pi_sampler``, bounded, corrects that
(TRL ``vllm_importance_sampling_correction``, verl's TIS):

- ``token_truncate``: per token, ``w`` clamped to ``[weight_min, weight_max]``;
- ``token_mask``: per token, ``w`` set to 0 outside ``[weight_min, weight_max]``;
- ``sequence_truncate`` / ``sequence_mask``: the same on one weight per sequence,
  ``exp(sum_t (logp_old - logp_sampler))``, applied to all its tokens.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

MismatchMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
MISMATCH_MODES: tuple[str, ...] = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def mismatch_weights(
    logp_old: Tensor,
    logp_sampler: Tensor,
    valid: Tensor,
    mode: MismatchMode,
    weight_min: float | None,
    weight_max: float | None,
) -> tuple[Tensor, Tensor]:
    """Detached ``[B, T]`` weights and the ``[B, T]`` bool flags of those truncated or masked.

    Args:
        logp_old: ``[B, T]`` the learner's log-probs of the sampled tokens before the update.
        logp_sampler: ``[B, T]`` their log-probs under the distribution they were sampled from.
        valid: ``[B, T]`` tokens that carry loss; others count as a log-ratio of 0.
        mode: one of ``MISMATCH_MODES``.
        weight_min, weight_max: the bounds; None is unbounded on that side.
    """
    if mode not in MISMATCH_MODES:
        raise ValueError(f"mismatch_correction must be one of {MISMATCH_MODES}, got {mode!r}")
    valid = valid.bool()
    diff = torch.where(valid, logp_old.detach() - logp_sampler.detach(), torch.zeros_like(logp_old))
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True).expand_as(diff)
    weights = torch.exp(diff)
    low = -math.inf if weight_min is None else weight_min
    high = math.inf if weight_max is None else weight_max
    outside = ((weights < low) | (weights > high)) & valid
    if mode.endswith("truncate"):
        weights = weights.clamp(min=weight_min, max=weight_max)
    else:
        weights = weights.masked_fill(outside, 0.0)
    return weights, outside
