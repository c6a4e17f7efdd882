"""The drafter's loss (docs/algorithm.md, section 8), shared by pretraining and online learning.

loss = feature_weight * SmoothL1(predicted h_{t+1}, h_{t+1})
     + ce_weight * CE(softmax(W h_{t+1}) || log_softmax(W predicted h_{t+1}))

W is the policy's LM head (frozen): the soft cross-entropy asks the draft distribution to
match the policy's next-token distribution, the regression asks the feature to match (EAGLE's
recipe, FastGRPO's weights 2.0 and 0.1). Only the drafter gets gradients.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .feature_log import DraftSequences


class DraftLoss(NamedTuple):
    total: torch.Tensor  # scalar, with gradients into the drafter
    feature: float  # SmoothL1 per feature element
    soft_ce: float  # nats per entry
    entries: int


def predicted_features(drafter, batch: DraftSequences, embed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(predicted, target) features [M, D] of every training entry of `batch` (teacher forcing)."""
    width = batch.tokens.shape[1] - 1
    steps = torch.arange(width, device=batch.tokens.device)
    positions = batch.start_positions[:, None] + steps
    predicted = drafter(batch.features[:, :-1], F.embedding(batch.tokens[:, :-1], embed), positions)
    valid = steps[None] < (batch.lengths - 1)[:, None]
    return predicted[valid], batch.features[:, 1:][valid]


def draft_loss(drafter, batch: DraftSequences, lm_head: torch.Tensor, embed: torch.Tensor, feature_weight: float,
               ce_weight: float, chunk_tokens: int = 512) -> DraftLoss:
    """The loss over `batch`'s entries; `lm_head` [V, D] and `embed` [V, D] are the policy's (no gradients)."""
    lm_head, embed = lm_head.detach(), embed.detach()
    predicted, target = predicted_features(drafter, batch, embed)
    entries = predicted.shape[0]
    if entries == 0:
        raise ValueError("no training entries: every response is shorter than 2 tokens")
    feature = F.smooth_l1_loss(predicted.float(), target.float())
    soft_ce = predicted.new_zeros((), dtype=torch.float32)
    if ce_weight > 0:
        for start in range(0, entries, chunk_tokens):
            p, t = predicted[start : start + chunk_tokens], target[start : start + chunk_tokens]
            target_probs = torch.softmax(F.linear(t, lm_head).float(), dim=-1)
            draft_logp = torch.log_softmax(F.linear(p, lm_head).float(), dim=-1)
            soft_ce = soft_ce - (target_probs * draft_logp).sum()
        soft_ce = soft_ce / entries
    total = feature_weight * feature + ce_weight * soft_ce
    return DraftLoss(total, float(feature.detach()), float(soft_ce.detach()), entries)
