"""Distillation targets for head training: the policy's hidden states and next-token distributions.

One policy forward per batch of sequences (no cache) gives, at every response position t,
the hidden state h_t (kept in bf16) and the policy's next-token distribution, kept sparse as
its top-K log-probs plus the log-mass of the tail outside the top-K. The policy forward is
the expensive part; its outputs are computed once and reused by every epoch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .samples import SampledSequence


class SparseDistribution(NamedTuple):
    """A distribution kept sparse: its top-m log-probs, their ids and the log-mass of all other tokens."""

    top_logp: torch.Tensor  # [..., m]
    top_idx: torch.Tensor  # [..., m] ids: indices into the vocabulary (long where used as an index)
    tail_logp: torch.Tensor  # [...]


@dataclass
class DistillTargets:
    """Per response position t (flattened over sequences): what the heads learn from.

    Entry i holds h_t, the policy's distribution over x_{t+1} and x_{t+1} itself; entry i + j
    is position t + j of the same sequence while j <= remaining[i].
    """

    hidden: torch.Tensor  # [N, D] bf16: h_t
    top_logp: torch.Tensor  # [N, K] log p_t of its K most likely tokens (within the target vocabulary)
    top_idx: torch.Tensor  # [N, K] those tokens, as indices into the target vocabulary
    tail_logp: torch.Tensor  # [N] log-mass of all other tokens (of the target vocabulary)
    next_token: torch.Tensor  # [N] x_{t+1}, the sampled token (a model token id)
    target_token: torch.Tensor  # [N] x_{t+1} as an index into the target vocabulary; -1: not in it
    remaining: torch.Tensor  # [N] entries after i in the same sequence

    def __len__(self) -> int:
        return self.next_token.shape[0]


@torch.no_grad()
def sparse_distribution(logits: torch.Tensor, top_k: int) -> SparseDistribution:
    """(top-K log-probs, their ids, tail log-mass) of softmax(logits) [..., V] at temperature 1."""
    logits = logits.float()
    k = min(top_k, logits.shape[-1] - 1)  # keep a non-empty tail so its log-mass stays finite
    lse = logits.logsumexp(-1)
    top, idx = logits.topk(k, dim=-1)
    tail = logits.scatter(-1, idx, float("-inf")).logsumexp(-1)
    return SparseDistribution(top - lse[..., None], idx, tail - lse)


@torch.no_grad()
def compute_targets(model, sequences: list[SampledSequence], top_k: int = 64, batch_tokens: int = 8192,
                    chunk_positions: int = 512, progress: bool = True,
                    vocab: torch.Tensor | None = None) -> DistillTargets:
    """One no-cache policy forward per batch of (length-sorted) sequences; see DistillTargets.

    With `vocab` (token ids, e.g. a draft vocabulary) the targets are the policy's distribution
    restricted to those tokens and renormalised, indexed by position in `vocab`.
    """
    device = next(model.parameters()).device
    lm_head = model.lm_head.weight
    if vocab is not None:
        vocab = vocab.to(device)
        index_in_vocab = torch.full((lm_head.shape[0],), -1, dtype=torch.long, device=device)  # token id -> index
        index_in_vocab[vocab] = torch.arange(vocab.numel(), device=device)
        lm_head = lm_head.index_select(0, vocab)
    usable = [s for s in sequences if s.response_len >= 1]
    order = sorted(range(len(usable)), key=lambda i: len(usable[i].ids))
    parts: dict[int, tuple] = {}
    bar = tqdm(total=sum(s.response_len for s in usable), desc="targets", unit="pos", disable=not progress)
    start = 0
    while start < len(order):
        # Sorted by length, so the last sequence of a batch is its longest.
        end = start + 1
        while end < len(order) and len(usable[order[end]].ids) * (end + 1 - start) <= batch_tokens:
            end += 1
        rows = [usable[i] for i in order[start:end]]
        ids = torch.zeros(len(rows), max(len(s.ids) for s in rows), dtype=torch.long, device=device)
        for r, s in enumerate(rows):
            ids[r, : len(s.ids)] = torch.tensor(s.ids, device=device)
        # Logits at one position only: the LM head runs below, chunk by chunk, on what is kept.
        hidden = model(ids, logits_at=torch.zeros(len(rows), 1, dtype=torch.long, device=device)).hidden
        for r, (i, s) in enumerate(zip(order[start:end], rows)):
            h = hidden[r, s.prompt_len - 1: len(s.ids) - 1]  # positions whose next token is a response token
            chunks = [sparse_distribution(F.linear(h[c: c + chunk_positions], lm_head), top_k)
                      for c in range(0, h.shape[0], chunk_positions)]
            top, idx, tail = (torch.cat(x) for x in zip(*chunks))
            parts[i] = (h.to(torch.bfloat16), top, idx.to(torch.int32), tail,
                        torch.tensor(s.ids[s.prompt_len:], device=device))
            bar.update(s.response_len)
        start = end
    bar.close()
    hidden, top, idx, tail, nxt = (torch.cat(x) for x in zip(*(parts[i] for i in range(len(usable)))))
    remaining = torch.cat([torch.arange(s.response_len - 1, -1, -1, device=device) for s in usable])
    target_token = nxt if vocab is None else index_in_vocab[nxt]
    return DistillTargets(hidden, top, idx, tail, nxt, target_token, remaining)
