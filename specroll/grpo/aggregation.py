"""Reduction of a per-token ``[B, T]`` loss to the scalar that is back-propagated.

Modes:

- ``"token-mean"``: sum over all valid tokens of the batch / number of valid tokens, so every
  token weighs the same and long responses are not down-weighted (DAPO).
- ``"seq-mean-token-mean"``: mean over each sequence's tokens, then over sequences (original
  GRPO), so every response weighs the same.
- ``"seq-mean-token-sum"``: sum over each sequence's tokens, then mean over sequences.

Sequences without any valid token (e.g. masked truncated responses) are not counted by the
seq-mean modes: they carry no loss, so counting them would only shrink everyone else's weight.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
AGGREGATION_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def _check_mode(mode: str) -> None:
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"aggregation must be one of {AGGREGATION_MODES}, got {mode!r}")


def aggregation_denominator(mask: Tensor, mode: Aggregation) -> Tensor:
    """What ``aggregate`` divides by: valid tokens (token-mean) or non-empty sequences.

    Summing this over the micro-batches of a mini-batch gives the ``normalizer`` that makes
    their losses add up to the full mini-batch loss.

    Returns:
        A 0-dim integer tensor (``int()`` it to pass as ``normalizer``).
    """
    _check_mode(mode)
    valid = mask.bool()
    if mode == "token-mean":
        return valid.sum()
    return valid.any(dim=-1).sum()


def aggregate(
    values: Tensor, mask: Tensor, mode: Aggregation, normalizer: float | None = None
) -> Tensor:
    """Reduce ``values [B, T]`` over the positions where ``mask [B, T]`` is set.

    Args:
        values: per-token values; entries under a zero mask are ignored, even NaN/inf.
        mask: valid-token mask (bool or 0/1).
        mode: one of ``AGGREGATION_MODES``.
        normalizer: overrides the local denominator with the mini-batch-wide one
            (``aggregation_denominator`` summed over micro-batches), because DeepSpeed
            gradient accumulation sums micro-batch gradients and would otherwise weigh
            micro-batches equally regardless of their size.

    Returns:
        A 0-dim tensor; 0 when nothing is valid.
    """
    _check_mode(mode)
    if values.shape != mask.shape or values.dim() != 2:
        raise ValueError(
            f"values {tuple(values.shape)} and mask {tuple(mask.shape)} must both be [B, T]"
        )
    if normalizer is not None and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    valid = mask.bool()
    masked = torch.where(valid, values, torch.zeros_like(values))
    if mode == "token-mean":
        total = masked.sum()
    else:
        per_sequence = masked.sum(dim=-1)
        if mode == "seq-mean-token-mean":
            per_sequence = per_sequence / valid.sum(dim=-1).clamp_min(1)
        total = per_sequence.sum()
    if normalizer is None:
        return total / aggregation_denominator(valid, mode).clamp_min(1)
    return total / normalizer
