"""Context lookup drafts: a row's own earlier text as a second drafter beside the heads.

Responses repeat their context: numbers and names from the question, a calculation written
out and then its result (GSM8K's "48/2 = <<48/2=24>>24"), phrases of earlier steps. Where
a row's last 1..max_ngram tokens occurred before in its prompt or response, the tokens that
followed the latest such occurrence are a draft of what comes next (prompt lookup decoding).
The chain is merged into the heads' candidates (a node both propose is one node), scored by
an online estimate of how often such drafts are accepted, and the tree is then chosen from
both as before. It costs a few tensor comparisons, no model compute.

Exactness does not depend on it: the tree is a function of the row's context, and
verification samples every token from the policy whatever was drafted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import Candidates


@dataclass
class LookupDrafts:
    tokens: torch.Tensor  # [B, depth] the continuation after the latest earlier occurrence
    valid: torch.Tensor  # [B, depth] False past the end of the known text (or with no match)
    ngram: torch.Tensor  # [B] length of the matched suffix, 0 = no match


def lookup_drafts(tokens: torch.Tensor, lengths: torch.Tensor, max_ngram: int, depth: int) -> LookupDrafts:
    """For each row of `tokens` [B, L] (the first lengths[r] are real): the longest suffix of
    at most `max_ngram` tokens that also occurs earlier, and the `depth` tokens that followed
    its latest earlier occurrence."""
    batch, capacity = tokens.shape
    device = tokens.device
    start = torch.full((batch,), -1, dtype=torch.long, device=device)  # where the continuation begins
    ngram = torch.zeros(batch, dtype=torch.long, device=device)
    for n in range(min(max_ngram, capacity - 1), 0, -1):
        suffix = torch.gather(tokens, 1, (lengths[:, None] - n + torch.arange(n, device=device)).clamp(min=0))
        hits = (tokens.unfold(1, n, 1) == suffix[:, None]).all(-1)  # [B, L - n + 1]: window i = tokens i..i+n-1
        at = torch.arange(hits.shape[1], device=device)
        # An earlier occurrence, with at least one known token after it.
        earlier = hits & (at[None] + n < lengths[:, None])
        latest = torch.where(earlier, at[None], -1).max(dim=1).values
        found = (start < 0) & (latest >= 0)
        start = torch.where(found, latest + n, start)
        ngram = torch.where(found, n, ngram)
    columns = start[:, None] + torch.arange(depth, device=device)
    valid = (start[:, None] >= 0) & (columns < lengths[:, None])
    drafts = torch.gather(tokens, 1, columns.clamp(0, capacity - 1))
    return LookupDrafts(drafts, valid, ngram)


def add_lookup_candidates(cands: Candidates, lookup: LookupDrafts, step_logp: torch.Tensor) -> Candidates:
    """The candidates so far (the heads', and chains merged before) plus each row's lookup chain, as one set.

    step_logp [B, depth]: estimated log-probability that the chain's token at each depth is
    accepted given its parent was. Along the chain the score is their running sum. Where the
    chain follows nodes the heads drafted, those nodes are shared and scored as if either
    source alone could be right (`either`): two drafters agreeing is the strongest sign. From
    where the chain leaves the heads' nodes, its nodes are new candidates (appended after the
    heads', so parents still come first). Scores stay non-increasing along every path (both
    sources' are, and `either` is increasing in each), so any best-k prefix is still a
    connected tree.
    """
    batch, num_cands = cands.tokens.shape
    device = cands.tokens.device
    scores = cands.scores.clone()
    node = torch.full((batch,), -1, dtype=torch.long, device=device)  # chain's last node (-1: root)
    on_heads = torch.ones(batch, dtype=torch.bool, device=device)  # chain so far is all shared nodes
    chain_score = torch.zeros(batch, device=device)
    new = {"tokens": [], "parents": [], "scores": [], "head_probs": []}
    for d in range(lookup.tokens.shape[1]):
        token, usable = lookup.tokens[:, d], lookup.valid[:, d]
        chain_score = chain_score + step_logp[:, d]
        if num_cands:
            # Only a usable candidate is shared: an earlier chain's unusable nodes sit at no true depth.
            shared = ((cands.parents == node[:, None]) & (cands.tokens == token[:, None]) & torch.isfinite(scores)
                      & (on_heads & usable)[:, None])
            is_shared = shared.any(dim=1)
            at = shared.int().argmax(dim=1, keepdim=True)
            heads_score = scores.gather(1, at)[:, 0]
            scores.scatter_(1, at, torch.where(is_shared, either(heads_score, chain_score), heads_score)[:, None])
        else:  # nothing drafted before the chain (head drafts off): every node of it is new
            is_shared, at = torch.zeros_like(usable), node[:, None]
        added = usable & ~is_shared
        new["tokens"].append(token)
        new["parents"].append(node)
        new["scores"].append(torch.where(added, chain_score, float("-inf")))
        new["head_probs"].append(torch.where(added, step_logp[:, d].exp(), 0.0))
        node = torch.where(is_shared, at[:, 0], torch.where(added, num_cands + d, node))
        on_heads &= is_shared
    if not new["tokens"]:
        return cands
    extra = {k: torch.stack(v, dim=1) for k, v in new.items()}
    extra["depths"] = torch.arange(1, len(new["tokens"]) + 1, device=device).expand(batch, -1)  # chain node d: depth d + 1
    return Candidates(torch.cat((cands.tokens, extra["tokens"]), 1), torch.cat((cands.parents, extra["parents"]), 1),
                      torch.cat((cands.depths, extra["depths"]), 1), torch.cat((scores, extra["scores"]), 1),
                      torch.cat((cands.head_probs, extra["head_probs"].to(cands.head_probs.dtype)), 1), cands.proposals,
                      None if cands.cells is None else torch.nn.functional.pad(cands.cells, (0, len(new["tokens"])), value=-1))


def either(logp_a: torch.Tensor, logp_b: torch.Tensor) -> torch.Tensor:
    """log(1 - (1 - a)(1 - b)) of two log-probabilities: the noisy-OR of two estimates of the
    same event, for a node both drafters proposed (it ranks such nodes above the larger of the two)."""
    below_one = 1 - 1e-6
    return torch.log1p(-torch.exp(torch.log1p(-logp_a.exp().clamp(max=below_one)) + torch.log1p(-logp_b.exp().clamp(max=below_one))))


class LookupAcceptance:
    """Running estimate of P(the chain's token at depth d is accepted | its parent was), per
    matched suffix length (a longer match is a better draft).

    Learned from the emitted tokens themselves: each emitted token is a sample of the policy
    given its prefix whatever the tree held, so wherever the emitted prefix equals the
    chain's, the next emitted token says whether the chain's next token would be accepted,
    also for chain nodes the tree left out.
    """

    def __init__(self, max_ngram: int, depth: int, momentum: float, device, prior: float = 0.3) -> None:
        self.rate = torch.full((max_ngram, depth), prior, device=device)
        self.momentum = momentum

    def step_logp(self, lookup: LookupDrafts) -> torch.Tensor:
        """[B, depth] log acceptance estimates for each row's chain (rows without a match get
        the 1-token estimates, unused: their chain is not valid)."""
        return chain_step_logp(self.rate, lookup)

    def update(self, lookup: LookupDrafts, emitted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Learn from the step's emitted tokens [B, >= depth] (first counts[r] real); returns
        [B, depth]: whether the chain's token at each depth was emitted on the chain."""
        self.rate, on_chain = learned_rates(self.rate, self.momentum, lookup, emitted, counts)
        return on_chain


def chain_step_logp(rate: torch.Tensor, lookup: LookupDrafts) -> torch.Tensor:
    """`LookupAcceptance.step_logp` of the rates `rate` [max_ngram, depth']."""
    return rate[(lookup.ngram - 1).clamp(min=0), : lookup.tokens.shape[1]].log()


def learned_rates(rate: torch.Tensor, momentum: float, lookup: LookupDrafts, emitted: torch.Tensor,
                  counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`LookupAcceptance.update` as a pure function: the new rates [max_ngram, depth'] and the
    [B, depth] flags of chain tokens emitted on the chain."""
    depth = lookup.tokens.shape[1]
    seen = lookup.valid & (torch.arange(depth, device=counts.device)[None] < counts[:, None])
    match = seen & (emitted[:, :depth] == lookup.tokens)
    reached = torch.cat((torch.ones_like(match[:, :1]), match[:, :-1].long().cumprod(dim=1).bool()), dim=1)
    observed = (seen & reached).float()
    # [B, max_ngram]; a comparison, not one_hot, which reads the ids' range on the host.
    by_ngram = (lookup.ngram[:, None] == torch.arange(1, rate.shape[0] + 1, device=counts.device)).float()
    trials = by_ngram.T @ observed
    accepted = by_ngram.T @ (observed * match)
    old = rate[:, :depth]
    learned = (accepted / trials.clamp(min=1)).clamp(min=1e-3)
    new = torch.where(trials > 0, momentum * old + (1 - momentum) * learned, old)
    return torch.cat((new, rate[:, depth:]), dim=1), match & reached
