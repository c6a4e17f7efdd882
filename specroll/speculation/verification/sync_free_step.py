"""The sync-free tree step (`speculation.sync_free_trees`): a tree sized on the host, drafted,
verified and judged without reading anything on it, and the verify forward it shares with steps
that read.

Trees run at node buckets (`node_bucket`), so a compiled forward meets few shapes; drafting and
judging are the fixed-shape functions of `tree_step`, compiled where compiling is on.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import torch

from specroll.rollout.compiled_step import StepFunction, specialise
from specroll.rollout.decode_state import DecodeState
from specroll.rollout.stats import CompileStats

from ..config import SpeculationConfig
from ..drafting.heads import HorizonHeads
from ..drafting.lookup import LookupAcceptance
from .tree_step import JudgedTree, TreeShape, draft_tree_step, judge_tree_step


def node_bucket(nodes: int, max_nodes: int) -> int:
    """Nodes a verify forward runs with for a tree of `nodes` (root included): the next power of two."""
    return min(1 << (nodes - 1).bit_length(), max_nodes)


def sync_free_bucket(nodes: int, max_nodes: int) -> int:
    """The node bucket of a sync-free tree of `nodes`: trees of 2 verify in the 4-node bucket, as a
    dimension of size 1 would be a graph of its own."""
    return node_bucket(max(nodes, 4), max_nodes)


def sync_free_buckets(cfg: SpeculationConfig, budget: str) -> list[int]:
    """Node buckets of the sync-free tree steps that the resolved `budget` policy can run."""
    sizes = [cfg.fixed_nodes] if budget == "fixed" else range(max(cfg.min_nodes, 2), cfg.max_nodes + 1)
    return sorted({sync_free_bucket(n, cfg.max_nodes) for n in sizes if n > 1})


def runs_sync_free_trees(cfg: SpeculationConfig, device_type: str, budget: str) -> bool:
    """Whether a decoder's tree steps run sync-free (`speculation.sync_free_trees`; None: on GPUs):
    only where their size is known on the host (the cost model reads each step's drafts) and no
    feedback is read after each pass (Reflex, the slow path's head records), and drafting reads
    nothing on the host either (sibling and history lookup) and drafts the heads' paths."""
    asked = device_type == "cuda" if cfg.sync_free_trees is None else cfg.sync_free_trees
    return (asked and budget != "cost_model" and not cfg.uses_reflex and not cfg.uses_slow_path
            and not cfg.drafts_on_host)


def tree_forward(form: str, model, ids: torch.Tensor, positions: torch.Tensor, cache, mask: torch.Tensor,
                 span: int):
    """The verify forward at a fixed shape: logits and hidden states [B, nodes, ...] of every node.
    `form`: `model.form` (see `specialise`)."""
    specialise(form)
    out = model(ids, position_ids=positions, cache=cache, new_token_mask=mask, span=span)
    return out.logits, out.hidden


class SyncFreeRun(NamedTuple):
    """One sync-free tree step: what it judged, and where its time went."""

    judged: JudgedTree
    nodes: int  # the node bucket it ran in
    draft_s: float  # drafting and choosing each row's tree
    verify_s: float  # the verify forward and judging


class SyncFreeTreeStep:
    """A decoder's sync-free tree steps: drafting, its verify forward (`verify_forward`, shared
    with the decoder's steps that read) and judging, at the node buckets of `buckets`."""

    def __init__(self, cfg: SpeculationConfig, buckets: list[int], verify_forward: StepFunction, compile: bool,
                 device: torch.device) -> None:
        self.cfg = cfg
        self.buckets = buckets
        self.drafts = max(buckets, default=1) - 1  # what a step drafts: the largest bucket's
        self.verify_forward = verify_forward
        self.draft_step = StepFunction(draft_tree_step, compile, device)
        self.judge_step = StepFunction(judge_tree_step, compile, device)

    def shape(self, depth: int, lookup_momentum: float) -> TreeShape:
        cfg = self.cfg
        # PassCounts keeps emitted counts apart up to max_nodes.
        return TreeShape(self.drafts, depth, cfg.max_children, cfg.max_frontier,
                         cfg.lookup_ngram if cfg.context_lookup else 0, cfg.calibration_momentum, lookup_momentum,
                         cfg.max_nodes)

    def __call__(self, model, heads: HorizonHeads, depth: int, verify, state: DecodeState, budget: int,
                 observed: torch.Tensor, predicted: torch.Tensor, lookup: LookupAcceptance) -> SyncFreeRun:
        """A tree step of `budget` nodes, at most `depth` deep, for every row of `state`, drafted from
        heads calibrated by `observed` / `predicted` and `lookup`'s chain estimates, accepted by
        `verify`: the state moves past the accepted paths; what the pass teaches the decoder is in
        the judged tree."""
        t0 = time.perf_counter()
        nodes = sync_free_bucket(budget, self.cfg.max_nodes)
        shape = self.shape(depth, lookup.momentum)
        cache, history = state.cache, state.history
        lengths = cache.lengths[: state.batch_size]
        # A finished row waiting in the batch has its tree written from slot 0, so it always fits in the cache.
        lengths.mul_(state.live)
        lookup_rate = lookup.rate if shape.lookup_ngram else None
        form = f"{model.form} {heads.form}"
        drafted = self.draft_step(form, model, heads, state.last_tokens, state.last_hidden, observed, predicted,
                                  history.tokens, history.lengths, lookup_rate, budget - 1, nodes - 1, shape)
        t1 = time.perf_counter()
        logits, hidden = self.verify_forward(model.form, model, drafted.ids, lengths[:, None] + drafted.depths,
                                             cache, drafted.mask, state.span(nodes), begins_step=False)
        judged = self.judge_step(form, verify, drafted, logits, hidden, cache, state.live, state.rng.keys,
                                 state.rng.counters, observed, predicted, lookup_rate, state.params, shape,
                                 begins_step=False)
        t2 = time.perf_counter()
        # Copied, as what the next step reads: a GPU's next step replays over its graphs' outputs.
        state.last_hidden, state.rng.counters = judged.last_hidden.clone(), judged.counters.clone()
        state.cached_bound += min(budget, depth + 1)  # the longest path this tree can accept
        return SyncFreeRun(judged, nodes, t1 - t0, t2 - t1)

    def pop_compiles(self) -> list[CompileStats]:
        """Graphs its drafting and judging compiled since the last pop."""
        return [self.draft_step.pop(), self.judge_step.pop()]
