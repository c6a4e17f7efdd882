"""Drafts that read the coming draws (docs/design.md, "Drafts that read the coming draws").

With the coupled Gumbel sampler (`rollout.sampler: gumbel`) the token sampled at a tree node is,
with probability the mass of the policy's top K there, the argmax over those K of log p plus the
Gumbel noise of the node's draw (`rollout.draw_noise.token_gumbels`), and the draw a node of depth
d samples its child with is its row's stream d places ahead: known before the verify pass. A
drafter that reads that noise drafts the draw, not the mode:

- heads: a node's children are the best of log q(t) + g(t) over the heads' draft vocabulary
  (q: the head's distribution as the sampler samples, g: the draw's noise), each scored by the
  better of two calibrated chances: how often a child of its rank and margin was the draw
  (`reading_rates`, learned online from every pass) and its blind score (q times the per-depth
  calibration). Where the heads are less sure than the policy (under top-p the policy's nucleus is
  often its mode alone) the mode stays the better guess whatever the noise, and keeps its chain;
- chains (context lookup, siblings, history): their tokens stay, each scored by the chance that a
  token of probability a (the chain's learned acceptance) wins Gumbel-max given its own noise g:
  the others' best is a Gumbel at log(1 - a), so the chance is exp(-(1/a - 1) e^-g), whose mean
  over g is a.

Why it stays exact: every emitted token is the sampler's token for its draw whatever the tree
held (speculation/verification/verify.py); the tree decides only how many are emitted per pass.
"""
from __future__ import annotations

import math

import torch

from specroll.rollout.draw_noise import token_gumbels
from specroll.rollout.samplers import GUMBEL_CANDIDATES
from specroll.rollout.sampling import SamplingParams, sampling_logprobs, uniforms_at

# A child's margin: how far its log q + g lies below the best child's (the best's: how far above
# the second). Bins of it, in nats, split each rank's calibration.
MARGIN_EDGES = (0.25, 0.5, 1.0, 2.0)
MARGIN_BINS = len(MARGIN_EDGES) + 1
# The least chance a calibration cell or a chain's step holds, so a log stays finite.
_FLOOR = 1e-3


def node_draws(keys: torch.Tensor, counters: torch.Tensor, depth: int) -> torch.Tensor:
    """[B, depth] the draw each row's nodes of depth d (0 = the root) sample their child with:
    the row's stream d places past its counter, as verification gives them (`step.judge`)."""
    return uniforms_at(keys, counters[:, None] + torch.arange(depth, device=keys.device))


def read_children(logp: torch.Tensor, draft_vocab: torch.Tensor | None, draws: torch.Tensor, width: int,
                  params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `width` children of each frontier node that the noise of its row's draw favours.

    logp [B, F, V'] head log-probabilities over the draft vocabulary (`draft_vocab` [V'] token
    ids, None: the whole vocabulary), draws [B] the draw the children are sampled with by `params`
    (the sampler adds the noise to the policy's log-probabilities after temperature, top-k and
    top-p, among its GUMBEL_CANDIDATES likeliest tokens: the heads' are read after the same,
    among theirs). Returns
    [B, F, width]: the children's head log-probs, their token ids, and their calibration cells
    (rank under log q + g times MARGIN_BINS plus the margin's bin)."""
    vocab = logp.shape[-1]
    ids = torch.arange(vocab, device=logp.device) if draft_vocab is None else draft_vocab
    noise = token_gumbels(draws, ids.expand(draws.shape[0], -1)).to(logp.dtype)  # [B, V']
    sampled = sampling_logprobs(logp, params)
    kth = sampled.topk(min(GUMBEL_CANDIDATES, vocab), dim=-1).values[..., -1:]
    best, at = (sampled.masked_fill(sampled < kth, -math.inf) + noise[:, None]).topk(min(max(width, 2), vocab), dim=-1)
    below = best[..., :1] - best  # how far each lies below the best: its margin, but the best's own
    margin = torch.cat((below[..., 1:2], below[..., 1:]), dim=-1)[..., :width]
    edges = torch.tensor(MARGIN_EDGES, dtype=margin.dtype, device=margin.device)
    ranks = torch.arange(margin.shape[-1], device=margin.device)
    cells = ranks * MARGIN_BINS + torch.bucketize(margin.contiguous(), edges)
    at = at[..., :width]
    return logp.gather(-1, at), ids[at], cells


def reading_prior(depth: int, max_children: int, device) -> torch.Tensor:
    """[depth, max_children * MARGIN_BINS] the chance a child of each rank and margin is the draw,
    before any pass: halved per rank, the same for every margin and depth."""
    rank = torch.arange(max_children, device=device).repeat_interleave(MARGIN_BINS)
    return (0.5 ** (rank + 1.0))[None].expand(depth, -1).clone()


def reading_rates(rate: torch.Tensor, momentum: float, cells: torch.Tensor, depths: torch.Tensor,
                  parents: torch.Tensor, valid: torch.Tensor, path: torch.Tensor, counts: torch.Tensor,
                  live: torch.Tensor) -> torch.Tensor:
    """The calibration `rate` [depth, cells] after one pass: per cell, an EMA of how often a
    drafted child in it was the draw (accepted) when its parent was reached.

    cells, depths, parents, valid [B, M]: the tree's nodes (cells -1: not a head's reading
    child; parents in combined indexing, 0 = the root); path [B, H+1] and counts [B]: the
    accepted path (`Verdict`); live [B]: rows that count."""
    batch, nodes = cells.shape
    steps = torch.arange(path.shape[1], device=path.device)
    walked = torch.zeros(batch, nodes + 1, dtype=torch.long, device=path.device)
    walked.scatter_add_(1, path, (steps[None] < counts[:, None]).long())  # padding repeats the last node
    on_path = walked > 0
    tried = on_path.gather(1, parents) & valid & (cells >= 0) & live[:, None]
    flat = ((depths - 1).clamp(min=0) * rate.shape[1] + cells.clamp(min=0)).flatten()
    trials = torch.zeros(rate.numel(), device=rate.device).index_add_(0, flat, tried.flatten().float())
    hits = torch.zeros_like(trials).index_add_(0, flat, (tried & on_path[:, 1:]).flatten().float())
    learned = (hits / trials.clamp(min=1)).clamp(min=_FLOOR).view_as(rate)
    return torch.where(trials.view_as(rate) > 0, momentum * rate + (1 - momentum) * learned, rate)


def read_chain(step_logp: torch.Tensor, tokens: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """[B, depth] a chain's per-step log chances given the noise: its token at step d, blind
    chance a = exp(`step_logp`[:, d]), wins Gumbel-max under draw `draws`[:, d] with probability
    exp(-(1/a - 1) e^-g), g its own Gumbel under that draw."""
    depth = tokens.shape[1]
    noise = token_gumbels(draws[:, :depth], tokens[..., None])[..., 0].to(step_logp.dtype)
    chance = step_logp.exp().clamp(min=_FLOOR)
    return (-(1 / chance - 1) * torch.exp(-noise)).clamp(min=math.log(_FLOOR))
