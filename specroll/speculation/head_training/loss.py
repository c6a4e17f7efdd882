"""The loss of horizon heads and one training step on it, shared by head pretraining and the
slow path's head update (docs/algorithm.md sections 1 and 6).

Loss of head k (1-based) at t: w_k (a KL(p_{t+k} || q_k) + b NLL(x_{t+k+1} | q_k) + c KL(q_old || q_k)),
w_k = decay^(k-1), averaged over the positions whose targets lie inside the response.
Pretraining: a = 1, b = 0.3, c = 0. Slow path: a = 0.7, b = 0.3, c = 0.1, q_old being the
proposal of the heads that drafted, so that an update stays near them. (Section 6 names the
first term a cross-entropy to p: it differs from KL(p || q) by p's entropy, which does not
depend on the heads, so the gradient is the same.)
The KLs are taken between the coarsened distributions (each top-K token of the first
argument + one tail bucket): exact on the top-K, a lower bound of the full KL, and K + 1
entries per position instead of the vocabulary. The head side still needs its full softmax
(its normaliser and the NLL), so head logits are computed one head and one chunk of
positions at a time, in float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specroll.config_checks import check_int, check_number, check_probability

from ..drafting.heads import HorizonHeads
from .targets import DistillTargets, SparseDistribution


@dataclass(frozen=True)
class HeadLossConfig:
    distill_weight: float = 1.0  # a: weight of KL(p || q), p the policy's distribution
    nll_weight: float = 0.3  # b: weight of the realised-token NLL
    proximal_weight: float = 0.0  # c: weight of KL(q_old || q); 0 leaves the term out
    head_decay: float = 0.8  # w_k = head_decay^(k-1)
    chunk_positions: int = 512  # positions per LM-head evaluation (memory: chunk x vocab floats)

    def __post_init__(self) -> None:
        for name in ("distill_weight", "nll_weight", "proximal_weight"):
            check_number(name, getattr(self, name), 0)
        check_probability("head_decay", self.head_decay, low_open=True)
        check_int("chunk_positions", self.chunk_positions, 1)


def coarse_kl(z: torch.Tensor, lse: torch.Tensor, top_logp: torch.Tensor, top_idx: torch.Tensor,
              tail_logp: torch.Tensor) -> torch.Tensor:
    """Per row: KL(p || q) over p's top tokens + tail bucket; q = softmax(z), lse = logsumexp(z)."""
    logq_top = z.gather(-1, top_idx) - lse[..., None]
    logq_tail = z.scatter(-1, top_idx, float("-inf")).logsumexp(-1) - lse
    return (top_logp.exp() * (top_logp - logq_top)).sum(-1) + tail_logp.exp() * (tail_logp - logq_tail)


def sparse_kl(head_logits: torch.Tensor, p: SparseDistribution) -> torch.Tensor:
    """Per row: KL(p || q) over p's top-m + tail bucket; q = softmax(head_logits). The proximal
    term takes p = q_old."""
    z = head_logits.float()
    return coarse_kl(z, z.logsumexp(-1), p.top_logp, p.top_idx.long(), p.tail_logp)


def sparse_kl_and_nll(head_logits: torch.Tensor, top_logp: torch.Tensor, top_idx: torch.Tensor,
                      tail_logp: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: KL(p || q) over top-K + tail bucket, and -log q(token); q = softmax(head_logits).
    A token of -1 (outside q's vocabulary) has no NLL: 0."""
    z = head_logits.float()
    lse = z.logsumexp(-1)
    kl = coarse_kl(z, lse, top_logp, top_idx, tail_logp)
    known = token >= 0
    nll = (lse - z.gather(-1, token.clamp(min=0)[..., None])[..., 0]) * known
    return kl, nll


def head_loss(head_logits: torch.Tensor, target: SparseDistribution, token: torch.Tensor, *,
              distill_weight: float, nll_weight: float, proximal_weight: float = 0.0,
              proximal: SparseDistribution | None = None) -> torch.Tensor:
    """Per row: distill_weight KL(p || q) + nll_weight NLL(token | q) + proximal_weight KL(q_old || q),
    q = softmax(head_logits), p = `target`, q_old = `proximal` (needed when proximal_weight > 0)."""
    kl, nll = sparse_kl_and_nll(head_logits, target.top_logp, target.top_idx, target.tail_logp, token)
    loss = distill_weight * kl + nll_weight * nll
    if proximal_weight:
        if proximal is None:
            raise ValueError("head_loss: proximal_weight > 0 needs the proximal target q_old")
        loss = loss + proximal_weight * sparse_kl(head_logits, proximal)
    return loss


@dataclass
class HeadBatch:
    """Inputs of a set of positions t and, per head j (0-based), its targets."""

    hidden: torch.Tensor  # [n, D] float32: h_t, the heads' input
    path_emb: torch.Tensor  # [n, H, D] e(x_{t+1+j}): the path tokens (read by path heads only)
    valid: torch.Tensor  # [n, H] bool: head j has a target at t
    top_logp: torch.Tensor  # [n, H, K] p: log-probs of its top-K tokens
    top_idx: torch.Tensor  # [n, H, K] long: those tokens, as rows of the LM head the loss is given
    tail_logp: torch.Tensor  # [n, H] log-mass of p outside its top-K
    token: torch.Tensor  # [n, H] the sampled token, as a row of that LM head; -1: not in it (no NLL)
    proximal: SparseDistribution | None = None  # q_old, [n, H, m] and [n, H]: for a proximal term

    @classmethod
    def from_targets(cls, targets: DistillTargets, index: torch.Tensor, num_heads: int,
                     embed: torch.Tensor) -> HeadBatch:
        """Gathered inputs and per-head targets of the positions `index` (entry indices) of `targets`."""
        last = len(targets) - 1
        ahead = index[:, None] + torch.arange(num_heads + 1, device=index.device)  # [n, H+1]: t..t+H
        ahead = ahead.clamp(max=last)
        # path_emb[:, j] = e(x_{t+1+j}) = e(next token of entry t+j)
        path_emb = embed[targets.next_token[ahead[:, :num_heads]]]
        # Head j (0-based) learns the policy's distribution at entry t+j+1 and its sampled token.
        tgt = ahead[:, 1:]
        valid = targets.remaining[index][:, None] >= torch.arange(1, num_heads + 1, device=index.device)
        return cls(targets.hidden[index].float(), path_emb, valid, targets.top_logp[tgt],
                   targets.top_idx[tgt].long(), targets.tail_logp[tgt], targets.target_token[tgt])

    def rows(self, index: torch.Tensor) -> HeadBatch:
        """The positions `index` of this batch."""
        proximal = None if self.proximal is None else SparseDistribution(*(x[index] for x in self.proximal))
        return HeadBatch(self.hidden[index], self.path_emb[index], self.valid[index], self.top_logp[index],
                         self.top_idx[index], self.tail_logp[index], self.token[index], proximal)

    def head(self, j: int) -> tuple[torch.Tensor, ...]:
        """Targets of head j on its valid rows."""
        v = self.valid[:, j]
        return self.top_logp[v, j], self.top_idx[v, j], self.tail_logp[v, j], self.token[v, j]


def head_states(heads: HorizonHeads, batch: HeadBatch) -> torch.Tensor:
    return heads.all_states(batch.hidden, batch.path_emb if heads.head_type == "path" else None)


def train_step(heads: HorizonHeads, lm_head: torch.Tensor, batch: HeadBatch, loss: HeadLossConfig) -> float:
    """Accumulate gradients of the loss on `batch`; returns the loss.

    Head logits are never materialised for all heads at once: the loss is backpropagated to
    the head states one head and one chunk at a time, then once through the heads.
    """
    if loss.proximal_weight and batch.proximal is None:
        raise ValueError("train_step: HeadLossConfig.proximal_weight > 0 needs HeadBatch.proximal (q_old)")
    states = head_states(heads, batch)
    leaf = states.detach().requires_grad_()
    total = 0.0
    for j in range(heads.num_heads):
        rows = batch.valid[:, j].nonzero()[:, 0]
        if rows.numel() == 0:
            continue
        weight = loss.head_decay ** j / rows.numel()
        for c in range(0, rows.numel(), loss.chunk_positions):
            r = rows[c: c + loss.chunk_positions]
            z = F.linear(leaf[r, j], lm_head)
            target = SparseDistribution(batch.top_logp[r, j], batch.top_idx[r, j], batch.tail_logp[r, j])
            old = None if batch.proximal is None else SparseDistribution(*(x[r, j] for x in batch.proximal))
            chunk = weight * head_loss(z, target, batch.token[r, j], distill_weight=loss.distill_weight,
                                       nll_weight=loss.nll_weight, proximal_weight=loss.proximal_weight,
                                       proximal=old).sum()
            chunk.backward()
            total += chunk.item()
    states.backward(leaf.grad)
    return total
