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


def high_entropy_mask(entropy: Tensor, valid: Tensor, quantile: float) -> Tensor:
    """``[B, T]`` bool: the valid tokens whose entropy is in the top ``quantile`` of the valid ones.

    The threshold is ``torch.quantile`` of the valid entropies at ``1 - quantile`` and ties at it
    are kept, so ``quantile=1`` keeps every valid token and ``0`` the highest-entropy one(s)
    ("Beyond the 80/20 Rule", TRL ``top_entropy_quantile``). No valid token: all False.
    """
    if entropy.shape != valid.shape or entropy.dim() != 2:
        raise ValueError(f"entropy {tuple(entropy.shape)} and valid {tuple(valid.shape)} must both be [B, T]")
    valid = valid.bool()
    values = entropy.detach().float()[valid]
    if values.numel() == 0:
        return torch.zeros_like(valid)
    threshold = torch.quantile(values, 1.0 - quantile)
    return (entropy.detach().float() >= threshold) & valid
