"""Sparse draft trees: per response, the nodes most likely to be reached under a node budget.

A node's score is its estimated log-probability of being accepted: the sum along its path
of (head log-probability + per-depth calibration), never above its parent's (drafts that read
the coming draws, `reading`, sum the calibrated log chance that each node is its draw). Drafting
goes depth by depth over a frontier, batched over rows; the tree is then the best `num_drafts`
candidates. Because a child always ranks below its parent, any best-k prefix is a connected
tree, so one drafting pass serves every budget up to the maximum. Drafting fewer nodes
yields the same best-k trees for every k up to that number (each of those nodes ranks among
the best k of its depth, its parent among the frontier), and a tree of k drafts is at most
k deep: a small budget drafts only the depths and widths its tree can use.

Indexing: in a verify pass node 0 is the root (the last sampled token, not yet cached) and
draft node i (0-based) sits at index i + 1. Parents point into that combined indexing.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .reading import read_children

# Ranks a child strictly below its parent even when its own step has probability one.
_DEPTH_TIEBREAK = 1e-4


@dataclass
class Proposal:
    """The heads' sketch at one depth of drafting: for each frontier node, head k's top-m
    distribution over that node's children."""

    parents: torch.Tensor  # [B, F] candidate id of the node drafted from (-1: the root)
    top_logp: torch.Tensor  # [B, F, m] head log-probs (normalised over the draft vocabulary)
    top_ids: torch.Tensor  # [B, F, m] their token ids


@dataclass
class Candidates:
    """All drafted nodes of a step, in drafting order (parents before children)."""

    tokens: torch.Tensor  # [B, C]
    parents: torch.Tensor  # [B, C] candidate index of the parent, -1 for the root
    depths: torch.Tensor  # [B, C] 1..H
    scores: torch.Tensor  # [B, C] estimated log-probability of acceptance (-inf = unusable)
    head_probs: torch.Tensor  # [B, C] head probability of the token given its parent
    proposals: list[Proposal] | None = None  # the heads' sketch at each depth (`Proposal`), if asked for
    cells: torch.Tensor | None = None  # [B, C] reading calibration cell (`reading`; -1: none); None: blind drafts

    def ranked(self) -> torch.Tensor:
        """Candidate order by decreasing score, parents always before their children: [B, C]."""
        key = self.scores - _DEPTH_TIEBREAK * self.depths
        return key.argsort(dim=1, descending=True, stable=True)

    def expected_tokens(self, max_nodes: int) -> torch.Tensor:
        """[B, max_nodes] expected tokens per verify step with a tree of n = 1..max_nodes nodes."""
        order = self.ranked()[:, : max_nodes - 1]
        probs = torch.gather(self.scores, 1, order).exp()
        return torch.cat((torch.ones_like(probs[:, :1]), 1 + probs.cumsum(1)), dim=1)


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, M] draft tokens (combined index i + 1)
    parents: torch.Tensor  # [B, M] combined index of the parent (0 = root)
    depths: torch.Tensor  # [B, M]
    valid: torch.Tensor  # [B, M] False for padding when a row has fewer usable nodes
    head_probs: torch.Tensor  # [B, M]
    candidates: torch.Tensor | None = None  # [B, M] candidate id of each node (see `Candidates`)
    cells: torch.Tensor | None = None  # [B, M] reading calibration cell of each node (see `Candidates`)

    @property
    def num_drafts(self) -> int:
        return self.tokens.shape[1]


@torch.no_grad()
def draft_candidates(heads, model, hidden: torch.Tensor, roots: torch.Tensor, max_drafts: int,
                     log_calibration: torch.Tensor, max_children: int = 8, max_frontier: int = 4,
                     adjust=None, sketch_size: int = 0, draws: torch.Tensor | None = None,
                     log_reading: torch.Tensor | None = None, sampling=None) -> Candidates:
    """Draft up to `max_drafts` nodes per depth, to depth min(depth, max_drafts), for each row
    from its own heads.

    Only the `max_frontier` best nodes of a depth get children: with path heads every
    expanded node costs an LM-head product, the dominant drafting cost.

    hidden [B, D]: the policy's final hidden state at the position that produced `roots` [B].
    log_calibration [depth]: per-depth log correction of head probabilities (learned online); its
    length is how deep the tree drafts (the decoder's `depth`, at most the heads').
    adjust(depth, states [B, F, D]) -> a correction added to head `depth`'s (1-based) states before
    the LM head (Reflex). sketch_size m > 0 keeps each depth's top-m head distribution per frontier
    node (the matured records of Reflex and the slow path).
    draws [B, depth] (`reading.node_draws`): children are the ones the noise of their draw favours
    under `sampling` (SamplingParams), scored by the better of the reading calibration
    `log_reading` [depth, cells] and the blind score (`reading`); None: blind drafts.
    """
    batch = hidden.shape[0]
    width = min(max_children, max_drafts)
    state = hidden[:, None]  # [B, F, D]: the state each frontier node was drafted from
    frontier_tokens = roots[:, None]
    frontier_scores = torch.zeros(batch, 1, device=hidden.device)
    frontier_ids = torch.full((batch, 1), -1, dtype=torch.long, device=hidden.device)
    tokens, parents, sizes, scores, head_probs, proposals, cells = [], [], [], [], [], [], []
    next_id = 0
    lm_head = model.lm_head.weight  # the policy's own, read every call, so drafts follow its updates
    width = min(width, heads.draft_vocab_size(lm_head))
    for d in range(min(len(log_calibration), max_drafts)):
        if heads.head_type == "medusa":
            # A medusa head ignores the path: one distribution per row serves the whole depth.
            states = heads.step(d, None, hidden[:, None], None)
        else:
            emb = model.embed_tokens(frontier_tokens)
            states = heads.step(d, state, hidden[:, None].expand_as(emb), emb)
        logits_input = states if adjust is None else states + adjust(d + 1, states)
        logp = torch.log_softmax(heads.draft_logits(logits_input, lm_head).float(), dim=-1)
        if draws is None or sketch_size:
            top_lp, top_tok = logp.topk(min(max(width, sketch_size), logp.shape[-1]), dim=-1)  # [B, F or 1, >= W]
            if heads.draft_vocab is not None:
                top_tok = heads.draft_vocab[top_tok]
        if sketch_size:
            shape = (batch, frontier_ids.shape[1], min(sketch_size, top_lp.shape[-1]))
            proposals.append(Proposal(frontier_ids, top_lp[..., : shape[2]].expand(shape), top_tok[..., : shape[2]].expand(shape)))
        if draws is None:
            top_lp, top_tok = top_lp[..., :width], top_tok[..., :width]
            step = (top_lp + log_calibration[d]).clamp(max=0.0)
        else:
            top_lp, top_tok, cell = read_children(logp, heads.draft_vocab, draws[:, d], width, sampling)
            step = torch.maximum(log_reading[d][cell], (top_lp + log_calibration[d]).clamp(max=0.0))
        cand = (frontier_scores[..., None] + step).flatten(1)  # [B, F*W]
        keep = min(max_drafts, cand.shape[1])
        best, idx = cand.topk(keep, dim=1)
        parent_slot = idx // width
        flat_tok = top_tok.expand(batch, frontier_tokens.shape[1], width).flatten(1)
        flat_lp = top_lp.expand(batch, frontier_tokens.shape[1], width).flatten(1)
        tokens.append(torch.gather(flat_tok, 1, idx))
        parents.append(torch.gather(frontier_ids, 1, parent_slot))
        sizes.append(keep)
        scores.append(best)
        head_probs.append(torch.gather(flat_lp, 1, idx).exp())
        if draws is not None:
            cells.append(torch.gather(cell.expand(batch, frontier_tokens.shape[1], width).flatten(1), 1, idx))
        # The best kept nodes (topk sorts them) become the next frontier.
        width_next = min(max_frontier, keep)
        if heads.head_type == "path":
            state = torch.gather(states, 1, parent_slot[:, :width_next, None].expand(-1, -1, states.shape[-1]))
        frontier_tokens, frontier_scores = tokens[-1][:, :width_next], best[:, :width_next]
        frontier_ids = torch.arange(next_id, next_id + width_next, device=hidden.device)[None].expand(batch, -1)
        next_id += keep
    return Candidates(torch.cat(tokens, 1), torch.cat(parents, 1), level_depths(sizes, batch, hidden.device),
                      torch.cat(scores, 1), torch.cat(head_probs, 1), proposals if sketch_size else None,
                      torch.cat(cells, 1) if draws is not None else None)


def no_candidates(roots: torch.Tensor) -> Candidates:
    """An empty candidate set for each row of `roots` [B] (head drafts off: the lookups' chains are added to it)."""
    empty = roots.new_zeros(roots.shape[0], 0)
    return Candidates(empty, empty, empty, empty.float(), empty.float())


def level_depths(sizes: list[int], batch: int, device) -> torch.Tensor:
    """[B, sum(sizes)] the depth of each candidate, in drafting order, when depth d + 1 drafted
    sizes[d] of them: compiled, one kernel, where a concatenation of each depth's is one per depth."""
    position = torch.arange(sum(sizes), device=device)
    depth = torch.ones_like(position)
    for start in itertools.accumulate(sizes[:-1]):
        depth = depth + (position >= start).long()
    return depth[None].expand(batch, -1)


def select_tree(cands: Candidates, num_drafts: int, size: int | None = None) -> DraftTree:
    """The best `num_drafts` candidates per row, as a tree in drafting order; with `size`, padded
    to that many nodes by the next-best candidates marked invalid (a fixed shape for every
    `num_drafts` up to `size`: one compiled step serves them all)."""
    batch, num_cands = cands.tokens.shape
    size = min(num_drafts if size is None else size, num_cands)
    ranked = cands.ranked()[:, :size]
    # Padding sorts after the tree: candidates ranked past num_drafts count from num_cands on.
    padding = torch.arange(size, device=ranked.device)[None] >= num_drafts
    order = (ranked + padding * num_cands).sort(dim=1).values
    chosen, padding = order % num_cands, order >= num_cands  # drafting order: parents first
    tokens = torch.gather(cands.tokens, 1, chosen)
    depths = torch.gather(cands.depths, 1, chosen)
    scores = torch.gather(cands.scores, 1, chosen)
    head_probs = torch.gather(cands.head_probs, 1, chosen)
    cells = None if cands.cells is None else torch.gather(cands.cells, 1, chosen)
    # Map candidate ids to combined indices (root = 0, chosen node j = j + 1).
    combined = torch.zeros(batch, num_cands + 1, dtype=torch.long, device=tokens.device)
    combined.scatter_(1, chosen + 1, torch.arange(1, size + 1, device=tokens.device).expand(batch, -1))
    parents = torch.gather(combined, 1, torch.gather(cands.parents, 1, chosen) + 1)
    valid = torch.isfinite(scores) & ~padding
    return DraftTree(tokens, parents.masked_fill(~valid, 0), depths, valid, head_probs, chosen, cells)


def tree_attention_mask(tree: DraftTree, max_depth: int) -> torch.Tensor:
    """[B, 1+M, 1+M]: each node sees itself and its ancestors (the root included), for trees at
    most `max_depth` deep."""
    batch, m = tree.tokens.shape
    itself = torch.eye(m + 1, dtype=torch.bool, device=tree.tokens.device).expand(batch, -1, -1)
    root_parent = torch.zeros(batch, 1, dtype=torch.long, device=tree.tokens.device)
    parents = torch.cat((root_parent, tree.parents), 1)[:, :, None].expand(-1, -1, m + 1)
    mask = itself
    # Each round, a node sees what its parent saw: one more generation of ancestors, whatever M is.
    for _ in range(max_depth):
        mask = itself | torch.gather(mask, 1, parents)
    return mask
