"""A sync-free tree step's work, as two fixed-shape functions around the verify forward.

Where the host knows a step's tree size (fixed and concurrency budgets, static drafting:
`speculation.sync_free_trees`), nothing in the step reads on the host, so its work beside the
forward can run compiled too: on a GPU as CUDA graphs, where eagerly it was ~720 small
kernels around a compiled forward. `draft_tree_step` drafts (heads and context lookup) and
chooses each row's tree; `judge_tree_step` samples every node, applies the acceptance rule,
keeps the accepted path in the cache and learns from it (calibration, lookup acceptance,
counters). Both run at a node bucket: a tree of fewer drafts is the bucket's best candidates
with the rest marked invalid, so one graph serves every budget in a bucket. The same functions
run eagerly where compiling is off.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specroll.rollout.compiled_step import specialise
from specroll.rollout.sampling import SamplingParams, sampling_logprobs, uniforms_at

from ..drafting.lookup import LookupDrafts, add_lookup_candidates, chain_step_logp, learned_rates, lookup_drafts
from ..drafting.tree import DraftTree, draft_candidates, select_tree, tree_attention_mask
from .pass_counts import pass_increments


@dataclass(frozen=True)
class TreeShape:
    """What a decoder's tree-step graphs are specialised on (one pair of graphs serves every
    node bucket: the bucket is an argument)."""

    drafts: int  # nodes drafted per row, enough for the largest bucket
    depth: int  # deepest a tree drafts (the decoder's `depth`)
    max_children: int
    max_frontier: int
    lookup_ngram: int  # 0: no context lookup
    calibration_momentum: float
    lookup_momentum: float
    max_tokens: int  # the largest emitted count `PassCounts` keeps apart


@dataclass
class DraftedTree:
    """A step's trees and the verify forward's inputs."""

    tree: DraftTree
    lookup: LookupDrafts | None
    ids: torch.Tensor  # [B, nodes] root and draft tokens
    depths: torch.Tensor  # [B, nodes] 0 for the root
    mask: torch.Tensor  # [B, nodes, nodes] ancestors


@dataclass
class JudgedTree:
    """What a step emitted, and the drafter's updated running state."""

    tokens: torch.Tensor  # [B, H+1] emitted tokens (first `counts` real)
    logprobs: torch.Tensor  # [B, H+1]
    counts: torch.Tensor  # [B]
    last_hidden: torch.Tensor  # [B, D] the hidden state that produced each row's last token
    counters: torch.Tensor  # [B] each row's random stream advanced past its emitted tokens
    observed: torch.Tensor  # [H] calibration EMAs
    predicted: torch.Tensor  # [H]
    lookup_rate: torch.Tensor | None  # [max_ngram, H] lookup acceptance estimates
    pass_increments: torch.Tensor  # what the pass adds to `PassCounts.totals`


def draft_tree_step(form: str, model, heads, roots: torch.Tensor, hidden: torch.Tensor, observed: torch.Tensor,
                    predicted: torch.Tensor, history_tokens: torch.Tensor, history_lengths: torch.Tensor,
                    lookup_rate: torch.Tensor | None, num_drafts: int, tree_size: int, shape: TreeShape) -> DraftedTree:
    """Every row's tree of its best `num_drafts` candidates, padded to `tree_size` draft nodes
    (head probabilities calibrated by observed / predicted, see `calibrated`). The heads' best
    k of a larger drafting are the tree a drafting of k would give (see `tree`); the lookup
    chain, as long as the larger drafting allows, may share more of its nodes with the heads'
    (scored by both), so a budget below its bucket can choose another tree than a reading step
    would. Exactness never depends on which tree is drafted. `form`: the model's and the heads'
    (see `specialise`)."""
    specialise(form)
    log_calibration = (observed / predicted).log()
    cands = draft_candidates(heads, model, hidden, roots, shape.drafts, log_calibration, shape.max_children,
                             shape.max_frontier)
    lookup = None
    if shape.lookup_ngram:
        lookup = lookup_drafts(history_tokens, history_lengths, shape.lookup_ngram, min(shape.depth, shape.drafts))
        cands = add_lookup_candidates(cands, lookup, chain_step_logp(lookup_rate, lookup))
    tree = select_tree(cands, num_drafts, tree_size)
    ids, depths, mask = padded_tree_inputs(roots, tree, tree_size + 1, shape.depth)
    return DraftedTree(tree, lookup, ids, depths, mask)


def judge_tree_step(form: str, verify, drafted: DraftedTree, logits: torch.Tensor, hidden: torch.Tensor, cache,
                    live: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor, observed: torch.Tensor,
                    predicted: torch.Tensor, lookup_rate: torch.Tensor | None, params: SamplingParams,
                    shape: TreeShape) -> JudgedTree:
    """Sample every node of the verify forward's `logits` [B, nodes, V], accept by `verify`, keep
    each live row's accepted path in `cache` (finished rows keep nothing) and learn from it.
    `form`: the model's and the heads' (see `specialise`)."""
    specialise(form)
    logprobs = sampling_logprobs(logits, params)
    uniforms = None if params.greedy else uniforms_at(keys, counters[:, None] + drafted.depths)
    verdict = verify(logprobs, drafted.tree, uniforms, params.greedy, shape.depth)
    emitted = verdict.counts * live
    # The longest path any tree can accept, whatever its bucket: a width known without reading the counts.
    cache.commit_gather(verdict.path[:, : min(shape.drafts, shape.depth) + 1], emitted)
    last = torch.gather(verdict.path, 1, (verdict.counts - 1)[:, None])
    last_hidden = torch.gather(hidden, 1, last[..., None].expand(-1, -1, hidden.shape[-1]))[:, 0]
    observed, predicted = calibrated(observed, predicted, verdict, live, shape.calibration_momentum)
    on_chain = None
    if drafted.lookup is not None:
        lookup_rate, on_chain = learned_rates(lookup_rate, shape.lookup_momentum, drafted.lookup, verdict.tokens, emitted)
    increments = pass_increments(shape.max_tokens, shape.depth, verdict.counts, live, verdict.accepted_at_depth,
                                 on_chain)
    return JudgedTree(verdict.tokens, verdict.logprobs, verdict.counts, last_hidden, counters + verdict.counts,
                      observed, predicted, lookup_rate, increments)


def padded_tree_inputs(roots: torch.Tensor, tree: DraftTree, nodes: int,
                       max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids [B, nodes], depths [B, nodes] and ancestor mask [B, nodes, nodes] of every row's
    root and tree (at most `max_depth` deep), padded with nodes that see only themselves (their
    outputs are dropped)."""
    pad = nodes - 1 - tree.num_drafts
    ids = torch.nn.functional.pad(torch.cat((roots[:, None], tree.tokens), dim=1), (0, pad))
    depths = torch.nn.functional.pad(torch.cat((torch.zeros_like(roots[:, None]), tree.depths), 1), (0, pad))
    mask = tree_attention_mask(tree, max_depth)
    if pad:
        mask = torch.nn.functional.pad(mask, (0, pad, 0, pad))
        mask |= torch.eye(nodes, dtype=torch.bool, device=mask.device)
    return ids, depths, mask


def calibrated(observed: torch.Tensor, predicted: torch.Tensor, verdict, live: torch.Tensor,
               momentum: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per depth: EMA of the accepted rate and of the head mass drafted under the reached node,
    over live rows (observed / predicted calibrates head probabilities)."""
    acc = verdict.accepted_at_depth
    reached = torch.cat((torch.ones_like(acc[:, :1]), acc[:, :-1]), 1) & live[:, None]
    has_children = reached & (verdict.reached_node_prob > 0)
    n = has_children.sum(0).clamp(min=1)
    rate = (verdict.accepted_at_depth & has_children).sum(0) / n
    mass = (verdict.reached_node_prob * has_children).sum(0) / n
    m, used = momentum, has_children.any(0)
    return (torch.where(used, m * observed + (1 - m) * rate.clamp(min=1e-3), observed),
            torch.where(used, m * predicted + (1 - m) * mass.clamp(min=1e-3), predicted))
