"""Policy entropy over the vocabulary, a collapse signal for RL fine-tuning."""

from __future__ import annotations

import torch
from torch import Tensor

from specroll.grpo.aggregation import aggregate


def entropy_from_logits(logits: Tensor, mask: Tensor) -> Tensor:
    """Mean over valid tokens of ``H = -sum_v p_v log p_v`` with ``p = softmax(logits)``.

    Computed in float32 (bf16 logits lose the small probabilities) as
    ``logsumexp(z) - sum_v p_v z_v`` on max-shifted logits. Logits of
    ``-inf`` (banned tokens) contribute nothing instead of ``0 * -inf = NaN``.

    Args:
        logits: ``[B, T, V]``.
        mask: ``[B, T]`` valid-token mask.

    Returns:
        A 0-dim float32 tensor (differentiable, so it can also serve as a bonus term).
    """
    if logits.dim() != 3 or logits.shape[:2] != mask.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be [B, T, V] with mask {tuple(mask.shape)} = [B, T]"
        )
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    # Entropy is shift-invariant; shifting the max to 0 keeps logsumexp and the weighted sum
    # small, so their difference does not cancel away float32 precision for logits ~1e4.
    logits = logits - logits.amax(dim=-1, keepdim=True).detach()
    probs = torch.softmax(logits, dim=-1)
    # Zeroing the logit (not the product) keeps the backward pass free of 0 * -inf too.
    finite_logits = torch.where(probs > 0, logits, torch.zeros_like(logits))
    per_token = torch.logsumexp(logits, dim=-1) - (probs * finite_logits).sum(dim=-1)
    return aggregate(per_token, mask, "token-mean")
