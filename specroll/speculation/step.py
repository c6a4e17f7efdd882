"""One speculative step, top to bottom: draft -> verify -> judge -> learn.

Every row's last sampled token (the root) and a tree of drafts below it go through one forward
of the policy; the exact acceptance rule (`verification.verify`) keeps the drafted path that the
policy's own samples follow, plus the sample after it (the bonus token); what the pass showed
calibrates the drafters. gpt-fast's `speculative_decode` tells this in one function; here it is
four, which both of a decoder's tree steps call in this order:

1. draft (`candidates`, then `select_tree`): the heads' candidates and the context lookup chain,
   blind or reading the coming draws (`drafting.reading`), and the tree of the best of them;
2. verify (`tree_inputs`, `verify`): the tree padded to a node bucket, one forward of it;
3. judge (`judge`): every node sampled, the acceptance rule, the accepted path kept in the cache;
4. learn (`learn`): the heads' calibration, the lookup chain's acceptance, the counts.

The step that reads on the host (`SpeculativeDecoder.step`) sizes a tree from its drafts (the
cost model) and also learns on the host from each verdict (Reflex, the slow path's records,
sibling and history lookup). Where the host knows a step's tree size, the sync-free step
(`SyncFreeTreeStep`) runs the same four with nothing read on the host: drafting and judging as
two fixed-shape functions (`draft_step`, `judge_step`), compiled where compiling is on, at a node
bucket, so one graph serves every budget in it. That is the one place the two forms differ, side
by side at the end: a sync-free tree drafts for its bucket and keeps its best drafts (the rest
marked invalid), and keeps in the cache as much of the accepted path as the bucket's largest tree
can accept (`accepted_width`), where the reading step drafts for its budget and keeps what its
own tree can accept.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from specroll.rollout.compiled_step import StepFunction, specialise
from specroll.rollout.decode_state import DecodeState
from specroll.rollout.sampling import SamplingParams, sampling_logprobs, uniforms_at
from specroll.rollout.stats import CompileStats

from .config import SpeculationConfig
from .drafting.lookup import LookupDrafts, add_lookup_candidates, chain_step_logp, learned_rates, lookup_drafts
from .drafting.reading import node_draws, read_chain, reading_rates
from .drafting.suffix_drafts import SuffixChains
from .drafting.tree import Candidates, DraftTree, draft_candidates, no_candidates, select_tree, tree_attention_mask
from .verification.pass_counts import pass_increments
from .verification.verify import Verdict


@dataclass(frozen=True)
class StepSettings:
    """What a decoder's steps read besides tensors (constants of a compiled step's graphs)."""

    drafts: int  # candidates drafted per depth: a reading step's plan, a sync-free step's largest bucket's
    depth: int  # the deepest a tree drafts (the decoder's `depth`)
    max_children: int
    max_frontier: int
    lookup_ngram: int  # 0: no context lookup
    calibration_momentum: float
    lookup_momentum: float
    max_tokens: int  # the largest emitted count `PassCounts` keeps apart
    reading: SamplingParams | None  # the sampling whose coming draws drafts read (`drafting.reading`); None: blind


def step_settings(cfg: SpeculationConfig, drafts: int, depth: int, lookup_momentum: float,
                  params: SamplingParams) -> StepSettings:
    # PassCounts keeps emitted counts apart up to max_nodes.
    return StepSettings(drafts, depth, cfg.max_children, cfg.max_frontier,
                        cfg.lookup_ngram if cfg.context_lookup else 0, cfg.calibration_momentum, lookup_momentum,
                        cfg.max_nodes, params if reads_draws(cfg, params) else None)


def reads_draws(cfg: SpeculationConfig, params: SamplingParams) -> bool:
    """Whether drafts read the coming draws: `speculation.read_draws` where the coupled Gumbel
    sampler draws (the noise means nothing to inverse-CDF sampling, nor to greedy decoding)."""
    return cfg.read_draws and not params.greedy and params.sampler == "gumbel"


# 1. Draft


class Drafts(NamedTuple):
    """A reading step's drafts: every row's candidates, and the chains among them that learn from the verdict."""

    candidates: Candidates  # the heads' and lookups' drafts
    lookup: LookupDrafts | None  # each row's context lookup chain; None when off
    suffix: SuffixChains | None  # each row's sibling and history chains; None when both are off


class DraftedTree(NamedTuple):
    """What a reading step verifies: its node budget (1: a plain step), and the drafts and tree behind it."""

    budget: int
    candidates: Candidates | None  # the heads' and lookups' drafts; None in a plain step
    lookup: LookupDrafts | None  # each row's context lookup chain; None when off or plain
    suffix: SuffixChains | None  # each row's sibling and history chains; None when both are off or plain
    tree: DraftTree | None  # the budget's best nodes of the candidates; None in a plain step
    roots: torch.Tensor  # [B] each row's last token before the pass
    hidden: torch.Tensor  # [B, H] the policy's hidden state at it, which the heads drafted from


def candidates(heads, model, roots: torch.Tensor, hidden: torch.Tensor, log_calibration: torch.Tensor,
               history_tokens: torch.Tensor, history_lengths: torch.Tensor, lookup_rate: torch.Tensor | None,
               settings: StepSettings, adjust=None, sketch_size: int = 0, head_drafts: bool = True,
               chains=(), draws: torch.Tensor | None = None,
               reading_rate: torch.Tensor | None = None) -> tuple[Candidates, LookupDrafts | None]:
    """Every row's candidates: `settings.drafts` per depth, `settings.depth` deep, from the heads
    at `hidden` [B, D] below `roots` [B] (probabilities calibrated per depth by `log_calibration`
    [depth]; none with `head_drafts` off), merged with the row's context lookup chain in its
    history (scored by the lookup acceptance rates `lookup_rate`), then with `chains` ((chain,
    step log-probs) pairs: sibling and history lookup). With `draws` [B, depth] (`node_draws`)
    every source reads them (`drafting.reading`), the heads' children scored by `reading_rate`.
    `adjust`, `sketch_size`: see `draft_candidates`."""
    if head_drafts:
        cands = draft_candidates(heads, model, hidden, roots, settings.drafts, log_calibration, settings.max_children,
                                 settings.max_frontier, adjust, sketch_size, draws,
                                 None if draws is None else reading_rate.log(), settings.reading)
    else:
        cands = no_candidates(roots)
    lookup = None
    if settings.lookup_ngram:
        lookup = lookup_drafts(history_tokens, history_lengths, settings.lookup_ngram,
                               min(settings.depth, settings.drafts))
        chains = ((lookup, chain_step_logp(lookup_rate, lookup)), *chains)
    for chain, step_logp in chains:
        cands = add_lookup_candidates(cands, chain, step_logp if draws is None else read_chain(step_logp, chain.tokens, draws))
    return cands, lookup


def drafted_tree(budget: int, drafts: Drafts | None, roots: torch.Tensor, hidden: torch.Tensor) -> DraftedTree:
    """A reading step's tree: the best `budget` - 1 of its `drafts` (None: nothing drafted), or
    none for a plain step (`budget` 1). `roots` [B] and `hidden` [B, D]: what they were drafted from."""
    cands, lookup, suffix = drafts if drafts is not None else (None, None, None)
    tree = select_tree(cands, budget - 1) if budget > 1 else None
    return DraftedTree(budget, cands, lookup, suffix, tree, roots, hidden)


# 2. Verify


@dataclass
class TreeInputs:
    """A step's trees and the verify forward's inputs."""

    tree: DraftTree
    lookup: LookupDrafts | None
    ids: torch.Tensor  # [B, nodes] root and draft tokens
    depths: torch.Tensor  # [B, nodes] 0 for the root
    mask: torch.Tensor  # [B, nodes, nodes] ancestors


def node_bucket(nodes: int, max_nodes: int) -> int:
    """Nodes a verify forward runs with for a tree of `nodes` (root included): the next power of two."""
    return min(1 << (nodes - 1).bit_length(), max_nodes)


def tree_inputs(roots: torch.Tensor, tree: DraftTree, lookup: LookupDrafts | None, nodes: int,
                max_depth: int) -> TreeInputs:
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
    return TreeInputs(tree, lookup, ids, depths, mask)


def tree_forward(form: str, model, ids: torch.Tensor, positions: torch.Tensor, cache, mask: torch.Tensor,
                 span: int):
    """The verify forward at a fixed shape: logits and hidden states [B, nodes, ...] of every node.
    `form`: `model.form` (see `specialise`)."""
    specialise(form)
    out = model(ids, position_ids=positions, cache=cache, new_token_mask=mask, span=span)
    return out.logits, out.hidden


def verify(forward: StepFunction, model, state: DecodeState, inputs: TreeInputs,
           begins_step: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One `forward` (`tree_forward`, compiled or not) of every row's root and tree, written to the
    cache after the row's tokens: logits and hidden states [B, 1 + drafts, ...] of the tree's nodes."""
    nodes = inputs.ids.shape[1]
    lengths = state.cache.lengths[: state.batch_size]
    # A finished row waiting in the batch has its tree written from slot 0, so it always fits in the cache.
    lengths.mul_(state.live)
    logits, hidden = forward(model.form, model, inputs.ids, lengths[:, None] + inputs.depths, state.cache,
                             inputs.mask, state.span(nodes), begins_step=begins_step)
    kept = inputs.tree.num_drafts + 1
    if kept < nodes:  # the bucket's padding
        logits, hidden = logits[:, :kept], hidden[:, :kept]
    return logits, hidden


# 3. Judge


class Judged(NamedTuple):
    """A verify pass judged, and where each row stands after it."""

    verdict: Verdict
    logits: torch.Tensor  # [B, nodes, V] the verify forward's
    logprobs: torch.Tensor  # [B, nodes, V] their sampling log-probabilities
    last_hidden: torch.Tensor  # [B, D] the hidden state that produced each row's last token
    counters: torch.Tensor  # [B] each row's random stream advanced past its emitted tokens


def accepted_width(nodes: int, max_depth: int) -> int:
    """The longest path (bonus token included) that a tree of `nodes` nodes, root included and at
    most `max_depth` deep, can accept: known on the host without reading a verdict's counts."""
    return min(nodes, max_depth + 1)


def judge(rule, tree: DraftTree, logits: torch.Tensor, hidden: torch.Tensor, cache, live: torch.Tensor,
          keys: torch.Tensor, counters: torch.Tensor, params: SamplingParams, max_depth: int, width: int) -> Judged:
    """Sample every node of the verify forward's `logits` [B, nodes, V] with the draw of its row's
    stream (`keys`, `counters`) its depth ahead, accept by `rule` (`verify_tree`), and keep each
    live row's accepted path in `cache`, its first `width` nodes (`accepted_width`; finished rows
    keep nothing)."""
    logprobs = sampling_logprobs(logits, params)
    depths = torch.cat((torch.zeros_like(tree.depths[:, :1]), tree.depths), 1)
    uniforms = None if params.greedy else uniforms_at(keys, counters[:, None] + depths)
    verdict = rule(logprobs, tree, uniforms, params, max_depth)
    cache.commit_gather(verdict.path[:, :width], verdict.counts * live)
    last = torch.gather(verdict.path, 1, (verdict.counts - 1)[:, None])
    last_hidden = torch.gather(hidden, 1, last[..., None].expand(-1, -1, hidden.shape[-1]))[:, 0]
    return Judged(verdict, logits, logprobs, last_hidden, counters + verdict.counts)


def moved_past(state: DecodeState, last_hidden: torch.Tensor, counters: torch.Tensor, width: int) -> None:
    """Move `state` past a judged pass that kept at most `width` tokens per row in the cache."""
    # Copied, as what the next step reads: a GPU's next step replays over its graphs' outputs.
    state.last_hidden, state.rng.counters = last_hidden.clone(), counters.clone()
    state.cached_bound += width


def verify_and_judge(forward: StepFunction, model, rule, state: DecodeState, drafted: DraftedTree, max_nodes: int,
                     depth: int) -> Judged:
    """Verify and judge (2 and 3) the step's `drafted` tree at its node bucket, the way a step that
    reads on the host does: the accepted paths kept in the cache, the state moved past them."""
    inputs = tree_inputs(drafted.roots, drafted.tree, drafted.lookup, node_bucket(drafted.budget, max_nodes), depth)
    logits, hidden = verify(forward, model, state, inputs)
    width = accepted_width(drafted.budget, depth)
    judged = judge(rule, drafted.tree, logits, hidden, state.cache, state.live, state.rng.keys, state.rng.counters,
                   state.params, depth, width)
    moved_past(state, judged.last_hidden, judged.counters, width)
    return judged


# 4. Learn


@dataclass
class Learned:
    """What a tree pass taught: the drafters' updated running estimates, and its counts."""

    observed: torch.Tensor  # [H] calibration EMAs
    predicted: torch.Tensor  # [H]
    lookup_rate: torch.Tensor | None  # [max_ngram, H] lookup acceptance estimates; None: no context lookup
    reading_rate: torch.Tensor  # [H, cells] the reading calibration (`drafting.reading`)
    pass_increments: torch.Tensor  # what the pass adds to `PassCounts.totals`


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


def learn(verdict: Verdict, tree: DraftTree, live: torch.Tensor, observed: torch.Tensor, predicted: torch.Tensor,
          lookup_rate: torch.Tensor | None, lookup: LookupDrafts | None, reading_rate: torch.Tensor,
          settings: StepSettings) -> Learned:
    """What a tree pass's `verdict` on `tree` over the `live` rows teaches: the heads' calibration
    (blind, and where the tree read the draws, by rank and margin), the context lookup chain's
    acceptance (where `lookup` was drafted), and the pass counts."""
    observed, predicted = calibrated(observed, predicted, verdict, live, settings.calibration_momentum)
    if tree.cells is not None:
        reading_rate = reading_rates(reading_rate, settings.calibration_momentum, tree.cells, tree.depths, tree.parents,
                                     tree.valid, verdict.path, verdict.counts, live)
    on_chain = None
    if lookup is not None:
        lookup_rate, on_chain = learned_rates(lookup_rate, settings.lookup_momentum, lookup, verdict.tokens,
                                              verdict.counts * live)
    increments = pass_increments(settings.max_tokens, settings.depth, verdict.counts, live,
                                 verdict.accepted_at_depth, on_chain)
    return Learned(observed, predicted, lookup_rate, reading_rate, increments)


# The sync-free step: the same four, with drafting and judging as two fixed-shape functions.


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


def draft_step(form: str, model, heads, roots: torch.Tensor, hidden: torch.Tensor, observed: torch.Tensor,
               predicted: torch.Tensor, history_tokens: torch.Tensor, history_lengths: torch.Tensor,
               lookup_rate: torch.Tensor | None, keys: torch.Tensor, counters: torch.Tensor, reading_rate: torch.Tensor,
               num_drafts: int, tree_size: int, settings: StepSettings) -> TreeInputs:
    """Draft (1) as a fixed-shape function: every row's tree of its best `num_drafts` candidates
    of a drafting for the largest bucket, padded to `tree_size` draft nodes. The heads' best k of a
    larger drafting are the tree a drafting of k would give (see `drafting.tree`); the lookup
    chain, as long as the larger drafting allows, may share more of its nodes with the heads'
    (scored by both), so a budget below its bucket can choose another tree than a reading step
    would. Exactness never depends on which tree is drafted. Where `settings.reading`, drafts
    read the rows' draws (stream `keys`, `counters`). `form`: the model's and the heads' (see
    `specialise`)."""
    specialise(form)
    draws = node_draws(keys, counters, settings.depth) if settings.reading is not None else None
    cands, lookup = candidates(heads, model, roots, hidden, (observed / predicted).log(), history_tokens,
                               history_lengths, lookup_rate, settings, draws=draws, reading_rate=reading_rate)
    tree = select_tree(cands, num_drafts, tree_size)
    return tree_inputs(roots, tree, lookup, tree_size + 1, settings.depth)


@dataclass
class JudgedTree:
    """What a sync-free step emitted, where its rows stand, and what it taught."""

    tokens: torch.Tensor  # [B, H+1] emitted tokens (first `counts` real)
    logprobs: torch.Tensor  # [B, H+1]
    counts: torch.Tensor  # [B]
    last_hidden: torch.Tensor  # [B, D] the hidden state that produced each row's last token
    counters: torch.Tensor  # [B] each row's random stream advanced past its emitted tokens
    learned: Learned


def judge_step(form: str, rule, inputs: TreeInputs, logits: torch.Tensor, hidden: torch.Tensor, cache,
               live: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor, observed: torch.Tensor,
               predicted: torch.Tensor, lookup_rate: torch.Tensor | None, reading_rate: torch.Tensor,
               params: SamplingParams, settings: StepSettings) -> JudgedTree:
    """Judge (3) and learn (4) as one fixed-shape function. The path kept in the cache is as
    long as the largest bucket's tree can accept, whatever this tree's bucket: a width that is
    a constant of the graph. `form`: the model's and the heads' (see `specialise`)."""
    specialise(form)
    width = accepted_width(settings.drafts + 1, settings.depth)
    judged = judge(rule, inputs.tree, logits, hidden, cache, live, keys, counters, params, settings.depth, width)
    verdict = judged.verdict
    learned = learn(verdict, inputs.tree, live, observed, predicted, lookup_rate, inputs.lookup, reading_rate, settings)
    return JudgedTree(verdict.tokens, verdict.logprobs, verdict.counts, judged.last_hidden, judged.counters, learned)


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
        self.max_nodes = cfg.max_nodes
        self.buckets = buckets
        self.drafts = max(buckets, default=1) - 1  # what a step drafts: the largest bucket's
        self.verify_forward = verify_forward
        self.draft_step = StepFunction(draft_step, compile, device)
        self.judge_step = StepFunction(judge_step, compile, device)

    def __call__(self, model, heads, rule, state: DecodeState, budget: int, observed: torch.Tensor,
                 predicted: torch.Tensor, lookup_rate: torch.Tensor | None, reading_rate: torch.Tensor,
                 settings: StepSettings) -> SyncFreeRun:
        """A tree step of `budget` nodes for every row of `state`, drafted from heads calibrated by
        `observed` / `predicted` (or reading the draws, by `reading_rate`) and the lookup chain's
        rates `lookup_rate`, accepted by `rule`: the
        state moves past the accepted paths; what the pass teaches the decoder is in the judged tree."""
        t0 = time.perf_counter()
        nodes = sync_free_bucket(budget, self.max_nodes)
        form = f"{model.form} {heads.form}"
        inputs = self.draft_step(form, model, heads, state.last_tokens, state.last_hidden, observed, predicted,
                                 state.history.tokens, state.history.lengths, lookup_rate, state.rng.keys,
                                 state.rng.counters, reading_rate, budget - 1, nodes - 1, settings)
        t1 = time.perf_counter()
        logits, hidden = verify(self.verify_forward, model, state, inputs, begins_step=False)
        judged = self.judge_step(form, rule, inputs, logits, hidden, state.cache, state.live, state.rng.keys,
                                 state.rng.counters, observed, predicted, lookup_rate, reading_rate, state.params,
                                 settings, begins_step=False)
        t2 = time.perf_counter()
        moved_past(state, judged.last_hidden, judged.counters, accepted_width(budget, settings.depth))
        return SyncFreeRun(judged, nodes, t1 - t0, t2 - t1)

    def pop_compiles(self) -> list[CompileStats]:
        """Graphs its drafting and judging compiled since the last pop."""
        return [self.draft_step.pop(), self.judge_step.pop()]
