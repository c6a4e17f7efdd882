"""Speculative decoding step: draft a sparse tree per response, verify all trees in one pass.

Plugs into `RolloutEngine` like the plain decoder: it feeds each row's last sampled token
(the root) plus its draft tree, and returns the accepted tokens and the bonus token.
"""
from __future__ import annotations

import time
import warnings
from functools import partial
from typing import NamedTuple

import torch

from specroll.models import KVCache
from specroll.rollout.compiled_step import StepFunction, specialise
from specroll.rollout.engine import DecodeState, PlainDecoder, StepResult, cache_shape, span_bucket
from specroll.rollout.sampling import RowRandom, SamplingParams, sampling_logprobs
from specroll.rollout.token_history import TokenHistory

from .adaptation.head_records import RecordCollector
from .adaptation.maturation import matured_proposals
from .adaptation.reflex import FastState, SafetyGuard, matured_feedback, rms
from .budgets.policies import concurrency_budget, cost_model_budget, resolve_budget, speculation_may_pay
from .budgets.profile import get_profile
from .budgets.tree_gate import TreeGate
from .config import SpeculationConfig
from .drafting.heads import HorizonHeads, shipped_heads
from .drafting.lookup import LookupAcceptance, LookupDrafts, add_lookup_candidates, lookup_drafts
from .drafting.tree import Candidates, DraftTree, draft_candidates, select_tree
from .verification.pass_counts import PassCounts
from .verification.tree_step import TreeShape, calibrated, draft_tree_step, judge_tree_step, padded_tree_inputs
from .verification.verify import Verdict, verify_tree


def initial_heads(model, cfg: SpeculationConfig) -> HorizonHeads:
    """Heads from `cfg.heads_path`; "shipped" falls back to untrained heads when none fit."""
    path = cfg.heads_path
    if path == "shipped":
        try:
            path = str(shipped_heads(model.config.name))
            heads = HorizonHeads.load(path, model)
        except (ValueError, FileNotFoundError) as exc:
            warnings.warn(f"no usable shipped heads ({exc}); speculating with untrained heads")
            return HorizonHeads.for_model(model, cfg.head_type, cfg.num_heads)
        if (heads.head_type, heads.num_heads) != (cfg.head_type, cfg.num_heads):
            warnings.warn(f"shipped heads are {heads.num_heads} {heads.head_type} heads, not "
                          f"{cfg.num_heads} {cfg.head_type}; speculating with untrained heads")
            return HorizonHeads.for_model(model, cfg.head_type, cfg.num_heads)
        return heads
    if path:
        return HorizonHeads.load(path, model)
    return HorizonHeads.for_model(model, cfg.head_type, cfg.num_heads)


# With the cost model the running estimates plan each step's budget before it drafts, so a step
# drafts only the tree it can use. Probes that draft the full tree refresh the estimates of larger
# trees (of every tree, where none pays): every DRAFT_PROBE_EVERY steps where the heads' typical
# acceptance (a slow average) would pay at this batch size, so a passing dip stops speculation only
# briefly; elsewhere every RARE_PROBE_EVERY, since a full draft costs a good share of a large batch's
# step. The plan is the largest tree whose estimated rate is within PLAN_SLACK of the best: nearby
# sizes estimate close to each other, and planning the best one picked small trees that emitted less.
PLAN_SLACK = 0.9
DRAFT_PROBE_EVERY = 4
RARE_PROBE_EVERY = 16
TYPICAL_MOMENTUM = 0.98
COST_MODEL_MOMENTUM = 0.8


class DraftedTree(NamedTuple):
    """What a step verifies: its node budget (1: a plain step), and the drafts and tree behind it."""

    budget: int
    candidates: Candidates | None  # the heads' and lookup's drafts; None in a plain step
    lookup: LookupDrafts | None  # each row's context lookup chain; None when off or plain
    tree: DraftTree | None  # the budget's best nodes of the candidates; None in a plain step
    roots: torch.Tensor  # [B] each row's last token before the pass
    hidden: torch.Tensor  # [B, H] the policy's hidden state at it, which the heads drafted from


class SpeculativeDecoder:
    def __init__(self, model, cfg: SpeculationConfig, heads: HorizonHeads | None = None, compile: bool = False) -> None:
        self.model, self.cfg = model, cfg
        self.plain = PlainDecoder(model, compile)  # the step where no tree is verified
        device = next(model.parameters()).device
        self.verify_forward = StepFunction(tree_forward, compile, device)
        # Tree steps sized on the host run their drafting and judging as fixed-shape functions too.
        self.draft_tree_step = StepFunction(draft_tree_step, compile, device)
        self.judge_tree_step = StepFunction(judge_tree_step, compile, device)
        # The acceptance rule; exactness tests swap in a deliberately biased one as a negative control.
        self.verify = verify_tree
        self.max_tokens_per_step = cfg.max_nodes
        self.heads: HorizonHeads | None = None
        self.gate: TreeGate | None = None  # set once the profile is known
        self.set_heads(heads if heads is not None else initial_heads(model, cfg))
        self.profile = None
        device_type = device.type
        self.budget = resolve_budget(cfg.budget, device_type)
        self.trees_may_skip_reads = device_type == "cuda" if cfg.sync_free_trees is None else cfg.sync_free_trees
        self.tree_drafts = max(self.tree_buckets(), default=1) - 1  # what a sync-free step drafts: the largest bucket's
        self.reflex = cfg.reflex if cfg.uses_reflex else None
        self.guard = SafetyGuard(cfg.reflex)
        self.records = (RecordCollector(self.heads.num_heads, cfg.drift.depth_buckets, cfg.records_per_rollout,
                                       record_nodes=cfg.record_nodes)
                        if cfg.uses_slow_path else None)
        self.min_rows = self.plain.min_rows if self.sync_free_trees else 1  # steps that read compact to live rows
        if compile and device_type == "cuda" and not self.sync_free_trees:
            warnings.warn("compiled on a GPU, plain decoding outruns tree steps that read on the host (the cost "
                          "model, Reflex, head records: they draft and verify eagerly around a compiled forward; "
                          "docs/guide.md, Compiled decoding): rollout=vanilla is faster there")
        if compile:
            self.compile_steps()
        if self.budget == "cost_model" or (self.budget == "concurrency" and cfg.capacity is None):
            # Sync-free trees are timed whole, so their profile weighs drafting and judging too.
            tree_form = self.tree_form() if self.sync_free_trees and self.tree_buckets() else ""
            timed = self.profiled_steps() if tree_form else self.profiled_pass if compile else None
            self.profile = get_profile(model, cfg.profile_cache_len, timed, compile, tree_form,
                                       cfg.max_nodes if tree_form else None)
        self.capacity = cfg.capacity or (self.profile.capacity if self.profile else 1)
        # Trees sized by a measured capacity run only where they pay; a capacity set by hand, or
        # min_nodes above 1, sizes them alone.
        if self.budget == "concurrency" and self.profile is not None and self.profile.tree_steps and cfg.min_nodes == 1:
            self.gate = TreeGate(self.tree_buckets(), cfg.max_nodes, cfg.min_gain, device)
        self.start_running_estimates()  # outside inference mode, as set_heads; warm-ups and profiles taught nothing
        # Cost model: EMA of drafting seconds by the depth drafted (index 0: no drafting), and of
        # what a plain step and a tree step cost beyond their profiled forwards (None: not seen yet).
        self.draft_s = [0.0] * (self.heads.num_heads + 1)
        self.plain_extra_s: float | None = None
        self.tree_extra_s: float | None = None

    @property
    def compiled_on_cuda(self) -> bool:
        """Whether the steps replay CUDA graphs: the engine then keeps its cache at fixed addresses."""
        return self.plain.compiled_on_cuda

    def profiled_pass(self, ids: torch.Tensor, cache, mask: torch.Tensor) -> None:
        """One hardware-profile cell through this decoder's own steps: the plain step (sampling at
        the default temperature 1) for one node per row, the verify forward for a chain of more."""
        if ids.shape[0] < self.min_rows:  # a lone row runs beside a finished one: time that
            ids, mask = ids.repeat(self.min_rows, 1), mask.repeat(self.min_rows, 1, 1)
        batch, nodes = ids.shape
        span = span_bucket(int(cache.lengths[:batch].max()) + nodes, cache.max_len)
        if nodes == 1:
            keys, counters = (torch.zeros(batch, dtype=torch.long, device=ids.device) for _ in range(2))
            self.plain.decode(self.model.form, self.model, ids[:, 0], cache, span, keys, counters, SamplingParams())
        else:
            positions = cache.lengths[:batch, None] + torch.arange(nodes, device=ids.device)
            self.verify_forward(self.model.form, self.model, ids, positions, cache, mask, span)

    def tree_form(self) -> str:
        """What a sync-free tree step's cost depends on besides the model: the heads and the tree's settings."""
        cfg = self.cfg
        lookup = cfg.lookup_ngram if cfg.context_lookup else 0
        return (f"{self.heads.form} max_nodes={cfg.max_nodes} children={cfg.max_children} "
                f"frontier={cfg.max_frontier} lookup={lookup}")

    def profiled_steps(self):
        """What a hardware profile of sync-free trees times: `profiled_pass` for one node, else a
        whole tree step, on a state per profiled cache, made in the profile's first round (untimed)."""
        cached, states = self.cfg.profile_cache_len, {}

        def timed(ids: torch.Tensor, cache, mask: torch.Tensor) -> None:
            if ids.shape[1] == 1:
                return self.profiled_pass(ids, cache, mask)
            if id(cache) not in states:
                batch = max(ids.shape[0], self.min_rows)
                states[id(cache)] = filler_state(self.model, cache, batch, cached, cached + self.cfg.max_nodes)
            state = states[id(cache)]
            state.cached_bound = cached  # the profile restores the cache's lengths before each pass
            self.tree_step_sized_on_host(state, ids.shape[1])
        return timed

    @torch.inference_mode()
    def compile_steps(self) -> None:
        """Compile every graph decoding meets (the plain step, the verify forward and, for tree
        steps sized on the host, drafting and judging, at batch 1 where it runs and above) now:
        lazily, the first tree of a run would stall it for minutes on a CPU."""
        device = next(self.model.parameters()).device
        # Sizes that equal no other (5 cache rows, batch 2, 4 nodes, 11 history slots; 3 lookup n-grams
        # and 4 heads by default): dynamo would otherwise assume that two sizes it saw equal always
        # are, and recompile when they are not.
        cache = KVCache.for_model(self.model, *cache_shape(4, 4))
        if device.type == "cuda":
            cache.mark_static()  # as the engine's
        batches = range(self.min_rows, 3)  # batch 1 and above, or only above (`compiled_min_rows`)
        for batch in batches:
            for nodes in (1, 4):
                ids = torch.zeros(batch, nodes, dtype=torch.long, device=device)
                mask = torch.ones(nodes, nodes, dtype=torch.bool, device=device).tril().repeat(batch, 1, 1)
                self.profiled_pass(ids, cache, mask)
        if self.sync_free_trees:
            for batch in batches:
                state = filler_state(self.model, cache, batch, 3, 11)
                for nodes in self.tree_buckets():
                    self.tree_step_sized_on_host(state, nodes)

    def tree_buckets(self) -> list[int]:
        """Node buckets of the tree steps sized on the host that this decoder's budget can run."""
        cfg = self.cfg
        sizes = [cfg.fixed_nodes] if self.budget == "fixed" else range(max(cfg.min_nodes, 2), cfg.max_nodes + 1)
        return sorted({sync_free_bucket(n, cfg.max_nodes) for n in sizes if n > 1})

    def set_heads(self, heads: HorizonHeads) -> None:
        """Use `heads` from the next step on (call between generate calls). A later version of the
        heads drafting now (a slow-path update) keeps the running estimates of how well they
        draft, which a small update barely moves, and probes a closed tree gate at its first
        interval again; other heads start them afresh."""
        updated = self.heads is not None and heads.num_heads == self.heads.num_heads and heads.version > self.heads.version
        self.heads = heads.eval().use_prepacked_linears()
        if not updated:
            self.start_running_estimates()
        elif self.gate is not None:
            self.gate.heads_updated()

    def start_running_estimates(self) -> None:
        """The heads' calibration, the cost model's and the lookup's estimates at their priors."""
        device, heads = next(self.model.parameters()).device, self.heads
        # Per-depth calibration of head probabilities: observed / predicted acceptance (EMAs).
        self.observed = torch.ones(heads.num_heads, device=device)
        self.predicted = torch.ones(heads.num_heads, device=device)
        # Cost model: EMA over drafted steps of the mean expected tokens per row for N = 1..max_nodes.
        self.expected_per_row: torch.Tensor | None = None
        self.typical_per_row: torch.Tensor | None = None  # the same, averaged slowly
        self.steps_since_full_draft = 0
        if self.gate is not None:
            self.gate.reset()
        self.lookup_acceptance = LookupAcceptance(self.cfg.lookup_ngram, heads.num_heads, self.cfg.calibration_momentum, device)
        self.reset_stats()  # counters per depth of these heads

    def reset_stats(self) -> None:
        self.pass_counts = PassCounts(self.cfg.max_nodes, self.heads.num_heads, next(self.model.parameters()).device)
        self.stats = {"budget_per_step": [], "time_draft_s": 0.0, "time_verify_s": 0.0, "time_bookkeeping_s": 0.0,
                      "verify_steps": 0, "time_reflex_s": 0.0, "reflex_on_steps": 0, "reflex_records": 0,
                      "reflex_reliability": 0.0, "reflex_state_rms": 0.0, "reflex_resets": 0, "time_records_s": 0.0}

    def pop_stats(self) -> dict:
        s, counts = self.stats, self.pass_counts.read()
        if self.gate is not None:
            self.gate.read()  # the call's last trees, read with its counts
        out = verify_pass_stats(s, counts) | self.compile_stats()
        out["lookup_token_share"] = counts["lookup_accepted"] / max(counts["drafts_accepted"], 1)
        if self.records is not None:
            out["time_records_s"] = s["time_records_s"]
        if self.reflex is not None:
            # A generate call ends here: the guard judges it by its accepted length.
            self.guard.end_rollout(out["tokens_per_step_mean"])
            steps = max(s["verify_steps"], 1)
            out.update(time_reflex_s=s["time_reflex_s"], reflex_on_share=s["reflex_on_steps"] / steps,
                       reflex_records=s["reflex_records"], reflex_reliability=s["reflex_reliability"] / steps,
                       reflex_state_rms=s["reflex_state_rms"] / steps, reflex_resets=s["reflex_resets"],
                       reflex_guard_trips=self.guard.trips)
        self.reset_stats()
        return out

    def compile_stats(self) -> dict:
        """Graphs compiled since the last pop (of every step function) and their seconds."""
        steps = [self.plain.pop_stats(), *(f.pop() for f in (self.verify_forward, self.draft_tree_step, self.judge_tree_step))]
        return {name: sum(step[name] for step in steps) for name in steps[0]}

    def log_calibration(self) -> torch.Tensor:
        return (self.observed / self.predicted).log()

    def node_budget(self, active_rows: int) -> int:
        """N_t of the budgets that need no drafts to decide it (cut by the tree gate where it applies)."""
        cfg = self.cfg
        if self.budget == "fixed":
            return cfg.fixed_nodes
        budget = concurrency_budget(self.capacity, active_rows, cfg.min_nodes, cfg.max_nodes)
        if budget > 1 and self.gate is not None:
            # Costs as the step runs: at the power-of-two batch the engine compacts to, in its node bucket.
            batch = max(1 << (max(active_rows, 1) - 1).bit_length(), self.min_rows)
            bucket = self.gate.largest_allowed(self.profile, batch, sync_free_bucket(budget, cfg.max_nodes))
            return 1 if bucket is None else min(budget, bucket)
        return budget

    def draft(self, state: DecodeState, max_drafts: int):
        """The heads' candidates, plus each row's context lookup chain (None if off)."""
        adjust, sketch = None, self.cfg.reflex.sketch_size if self.reflex or self.records else 0
        if self.reflex is not None:
            fast = self.fast_state(state)
            if self.guard.allows and bool(fast.active(self.reflex).any()):
                adjust = partial(fast.correction, cfg=self.reflex)
                self.stats["reflex_on_steps"] += 1
        cands = draft_candidates(self.heads, self.model, state.last_hidden, state.last_tokens,
                                 max_drafts, self.log_calibration(), self.cfg.max_children,
                                 self.cfg.max_frontier, adjust, sketch)
        if not self.cfg.context_lookup:
            return cands, None
        history = state.history
        lookup = lookup_drafts(history.tokens, history.lengths, self.cfg.lookup_ngram, min(self.heads.num_heads, max_drafts))
        return add_lookup_candidates(cands, lookup, self.lookup_acceptance.step_logp(lookup)), lookup

    def planned_step_drafts(self, live_rows: int) -> int:
        """Nodes the next step drafts for `live_rows` unfinished rows (0: a plain step), decided
        on the host alone."""
        if self.budget == "cost_model":
            return self.planned_drafts(live_rows)
        return self.node_budget(live_rows) - 1

    @property
    def sync_free_trees(self) -> bool:
        """Whether tree steps read nothing on the host (`speculation.sync_free_trees`; but for the tree
        gate's counts, every `tree_gate.READ_EVERY` tree steps): where their size follows the rows
        live at the last read (fixed and concurrency budgets), and no Reflex or head records read
        their feedback. The cost model reads each step's drafts to size its tree."""
        return self.trees_may_skip_reads and self.budget != "cost_model" and self.reflex is None and self.records is None

    def next_step_sync_free(self, state: DecodeState) -> bool:
        """Whether the next step reads nothing on the host (a plain step always), so the engine
        runs it without a read and with finished rows left in the batch."""
        return self.sync_free_trees or self.planned_step_drafts(state.live_rows) == 0

    @torch.inference_mode()
    def step(self, state: DecodeState) -> StepResult:
        """One decode step of every row: draft a tree (or none), verify it in one pass (or take the
        plain step), then learn from the verdict. Where trees run without host reads, one
        fixed-shape tree step instead."""
        if self.sync_free_trees and (budget := self.node_budget(state.live_rows)) > 1:
            return self.tree_step_sized_on_host(state, budget)
        t0 = time.perf_counter()
        batch = state.last_tokens.shape[0]  # finished rows included before a sync-free step
        drafted = self.drafted_tree(state)
        t1 = time.perf_counter()
        if drafted.budget > 1:
            verdict, logits, logprobs = self.verify_pass(state, drafted.tree, drafted.budget)
        else:
            verdict, logits, logprobs = self.plain_pass(state), None, None
        t2 = time.perf_counter()
        self.learn_from_pass(state, drafted, verdict, logits, logprobs)
        ended = time.perf_counter()
        self.stats["time_draft_s"] += t1 - t0
        self.stats["time_verify_s"] += t2 - t1
        self.stats["time_bookkeeping_s"] += ended - t2
        if self.budget == "cost_model":
            self.note_pass(batch, drafted.budget, ended - t1)
        return StepResult(verdict.tokens, verdict.logprobs, verdict.counts)

    def drafted_tree(self, state: DecodeState) -> DraftedTree:
        """This step's drafts and the tree it verifies, sized by the node budget (1: a plain step)."""
        started = time.perf_counter()
        drafts, cands, lookup = self.planned_step_drafts(state.live_rows), None, None
        budget = 1 if drafts == 0 else drafts + 1
        if drafts > 0:
            cands, lookup = self.draft(state, drafts)
        if self.budget == "cost_model":
            # The running estimates said how many nodes to draft (none where drafting would not
            # pay); this step's drafts then pick N_t, never above what was drafted.
            if drafts > 0:
                self.note_drafted(cands, drafts, time.perf_counter() - started)
                budget = cost_model_budget(cands.expected_tokens(drafts + 1), self.profile, state.last_tokens.shape[0],
                                           self.cfg.min_nodes, drafts + 1, self.drafting_s(), min_gain=self.cfg.min_gain)
            else:
                self.steps_since_full_draft += 1
        if budget == 1:
            self.pass_counts.add_plain(state.live)  # finished rows emit nothing
            if self.gate is not None:
                self.gate.note_plain()
        tree = select_tree(cands, budget - 1) if budget > 1 else None
        return DraftedTree(budget, cands, lookup, tree, state.last_tokens, state.last_hidden)

    def learn_from_pass(self, state: DecodeState, drafted: DraftedTree, verdict: Verdict, logits, logprobs) -> None:
        """What a pass teaches (`logits`, `logprobs`: the verify forward's, None after a plain step):
        the heads' calibration, the lookup chain's acceptance, the pass counts, Reflex's fast state
        and the slow path's head records."""
        budget, cands, tree = drafted.budget, drafted.candidates, drafted.tree
        if budget > 1:
            self.update_calibration(verdict, state.live)
        emitted = verdict.counts * state.live  # finished rows waiting in the batch emit nothing
        lookup = drafted.lookup
        on_chain = None if lookup is None else self.lookup_acceptance.update(lookup, verdict.tokens, emitted)
        self.record(verdict, budget, state.live, on_chain)
        matured = matured_proposals(cands.proposals, tree, verdict) if budget > 1 and cands.proposals else None
        if self.reflex is not None:
            self.learn_reflex(state, matured, verdict, logprobs)
        if self.records is not None and matured is not None:
            started = time.perf_counter()
            self.records.add_pass(matured, logits, verdict, tree, drafted.hidden, drafted.roots,
                                  state.history.lengths - state.prompt_lengths, state.row_ids, self.heads.version,
                                  proposals=cands.proposals, draft_vocab=self.heads.draft_vocab)
            self.stats["time_records_s"] += time.perf_counter() - started

    def tree_step_sized_on_host(self, state: DecodeState, budget: int) -> StepResult:
        """A tree step of `budget` nodes that reads nothing on the host (see `speculation.tree_step`; the
        tree gate reads its counts every READ_EVERY steps): drafting, the verify forward and
        judging, each compiled where compiling is on."""
        t0 = time.perf_counter()
        nodes = sync_free_bucket(budget, self.cfg.max_nodes)
        shape = TreeShape(self.tree_drafts, self.cfg.max_children, self.cfg.max_frontier,
                          self.cfg.lookup_ngram if self.cfg.context_lookup else 0, self.cfg.calibration_momentum,
                          self.lookup_acceptance.momentum, self.pass_counts.max_tokens)
        cache, history = state.cache, state.history
        lengths = cache.lengths[: state.batch_size]
        # A finished row waiting in the batch has its tree written from slot 0, so it always fits in the cache.
        lengths.mul_(state.live)
        lookup_rate = self.lookup_acceptance.rate if shape.lookup_ngram else None
        form = f"{self.model.form} {self.heads.form}"
        drafted = self.draft_tree_step(form, self.model, self.heads, state.last_tokens, state.last_hidden,
                                       self.observed, self.predicted, history.tokens, history.lengths, lookup_rate,
                                       budget - 1, nodes - 1, shape)
        t1 = time.perf_counter()
        logits, hidden = self.verify_forward(self.model.form, self.model, drafted.ids, lengths[:, None] + drafted.depths,
                                             cache, drafted.mask, state.span(nodes), begins_step=False)
        judged = self.judge_tree_step(form, self.verify, self.heads, drafted, logits, hidden, cache, state.live,
                                      state.rng.keys, state.rng.counters, self.observed, self.predicted, lookup_rate,
                                      state.params, shape, begins_step=False)
        t2 = time.perf_counter()
        # Copied, as what the next step reads: a GPU's next step replays over its graphs' outputs.
        state.last_hidden, state.rng.counters = judged.last_hidden.clone(), judged.counters.clone()
        with torch.inference_mode(False):  # the decoder's own estimates outlive the generate call
            self.observed, self.predicted = judged.observed.clone(), judged.predicted.clone()
            if lookup_rate is not None:
                self.lookup_acceptance.rate = judged.lookup_rate.clone()
        self.pass_counts.totals += judged.pass_increments
        if self.gate is not None:
            self.gate.note_tree(nodes, judged.pass_increments[: self.max_tokens_per_step + 1])
        state.cached_bound += min(budget, self.heads.num_heads + 1)  # the longest path this tree can accept
        self.stats["verify_steps"] += 1
        self.stats["budget_per_step"].append(budget)
        self.stats["time_draft_s"] += t1 - t0
        self.stats["time_verify_s"] += t2 - t1
        return StepResult(judged.tokens, judged.logprobs, judged.counts)

    def verify_pass(self, state: DecodeState, tree, budget: int):
        """One forward over every row's root and tree, the exact acceptance rule, and the
        accepted paths kept in the cache: (verdict, logits, sampling log-probs)."""
        roots, cache = state.last_tokens, state.cache
        lengths = cache.lengths[: roots.shape[0]]
        # Padded to a bucket of node counts, so the compiled forward meets few shapes.
        nodes = node_bucket(budget, self.cfg.max_nodes)
        ids, depths, mask = padded_tree_inputs(roots, tree, nodes, self.heads.num_heads)
        logits, hidden = self.verify_forward(self.model.form, self.model, ids, lengths[:, None] + depths, cache, mask,
                                             state.span(nodes))
        logits, hidden = logits[:, :budget], hidden[:, :budget]
        logprobs = sampling_logprobs(logits, state.params)
        uniforms = None if state.params.greedy else state.rng.peek(depths[:, :budget])
        verdict = self.verify(logprobs, tree, uniforms, state.params.greedy, self.heads.num_heads)
        state.rng.advance(verdict.counts)
        # The longest path a tree of this budget can accept, known on the host without reading the counts.
        width = min(budget, self.heads.num_heads + 1)
        cache.commit_gather(verdict.path[:, :width], verdict.counts * state.live)
        state.cached_bound += width
        last = torch.gather(verdict.path, 1, (verdict.counts - 1)[:, None])
        state.last_hidden = torch.gather(hidden, 1, last[..., None].expand(-1, -1, hidden.shape[-1]))[:, 0]
        return verdict, logits, logprobs

    def plain_pass(self, state: DecodeState) -> Verdict:
        """A root-only step is the plain decode step (compiled where that is on), so a step that
        does not speculate costs what plain decoding does; its verdict accepts nothing."""
        step = self.plain.step(state)
        if self.plain.compiled_on_cuda:
            # Copied, as judging copies its own: the next step reads it (drafting, head records) after a
            # CUDA graph begins a new step, which may replay over the plain step's outputs.
            state.last_hidden = state.last_hidden.clone()
        batch, device = step.tokens.shape[0], step.tokens.device
        nothing = torch.zeros(batch, 0, device=device)
        return Verdict(path=torch.zeros(batch, 1, dtype=torch.long, device=device), counts=step.counts,
                       tokens=step.tokens, logprobs=step.logprobs, accepted_at_depth=nothing.bool(),
                       reached_node_prob=nothing)

    def pop_head_records(self):
        """Slow path: (HeadTelemetry, MaturedRecords or None) of the generate calls since the last pop."""
        if self.records is None:
            raise ValueError("this decoder collects no head records: speculation.adaptation uses no slow path")
        return self.records.pop()

    def fast_state(self, state: DecodeState) -> FastState:
        """Reflex's per-response state, created with the generate call's rows (all at zero)."""
        if state.drafter_state is None:
            state.drafter_state = FastState(len(state.row_ids), self.model.config.hidden_size, state.last_hidden.device)
        return state.drafter_state

    def learn_reflex(self, state: DecodeState, matured, verdict, logprobs: torch.Tensor) -> None:
        """Feed the records this pass matured into each row's fast state (None: nothing was drafted)."""
        started = time.perf_counter()
        fast, cfg = self.fast_state(state), self.reflex
        if matured is not None:
            feedback = matured_feedback(matured, logprobs, self.model.lm_head.weight, cfg, self.heads.draft_vocab)
        else:
            feedback = FastState.no_feedback(verdict.counts.shape[0], self.model.config.hidden_size, verdict.counts.device)
        resets = fast.resets
        fast.update(feedback, verdict.counts, cfg)
        s = self.stats
        s["reflex_records"] += int(feedback.records.sum())
        s["reflex_resets"] += fast.resets - resets
        s["reflex_reliability"] += float(fast.reliability.mean())
        s["reflex_state_rms"] += float(rms(fast.state).mean())
        s["time_reflex_s"] += time.perf_counter() - started

    def planned_drafts(self, batch: int) -> int:
        """Cost model: how many nodes this step drafts (0: a plain step). Where a tree pays by
        the running estimates, the largest one within PLAN_SLACK of the best; now and then the
        full tree as a probe (see DRAFT_PROBE_EVERY); none where not even perfect drafts could pay."""
        cfg, full = self.cfg, self.cfg.max_nodes - 1
        least = cfg.min_nodes - 1
        if not speculation_may_pay(self.profile, batch, cfg.max_nodes, self.heads.num_heads, self.drafting_s()):
            # Where only the measured drafting time rules speculation out, still probe rarely: that
            # time can fall (a first draft on a GPU loads kernels), and one slow draft must not end drafting.
            probe = (max(self.draft_s) > 0 and self.steps_since_full_draft >= RARE_PROBE_EVERY
                     and speculation_may_pay(self.profile, batch, cfg.max_nodes, self.heads.num_heads))
            return full if probe else least
        if self.expected_per_row is None:
            return full  # nothing drafted yet: draft to find out
        pays = self.best_budget(self.expected_per_row, batch) > 1
        planned = max(self.best_budget(self.expected_per_row, batch, PLAN_SLACK) - 1 if pays else 0, least)
        if planned == full:
            return full
        if planned > 0:  # its own drafts keep this tree's estimates fresh; larger ones can wait
            probe_every = RARE_PROBE_EVERY
        elif self.best_budget(self.typical_per_row, batch) > 1:
            probe_every = DRAFT_PROBE_EVERY
        else:
            probe_every = RARE_PROBE_EVERY
        return full if self.steps_since_full_draft >= probe_every else planned

    def best_budget(self, expected_per_row: torch.Tensor, batch: int, slack: float = 1.0) -> int:
        """The N that `batch` rows expecting these tokens per N would get (see cost_model_budget)."""
        expected = expected_per_row.expand(batch, -1)
        return cost_model_budget(expected, self.profile, batch, 1, self.cfg.max_nodes, self.drafting_s(), slack,
                                 self.cfg.min_gain)

    def drafting_s(self) -> list[float]:
        """Estimated seconds a tree of 1..max_nodes nodes costs beyond its profiled verify forward:
        its drafting (a tree of n nodes drafts min(n - 1, H) depths: the EMA for that depth, else
        the full tree's scaled by depth) plus what a tree step's own work (sampling every node,
        the acceptance rule, keeping the path) adds over a plain step's, the profile times neither."""
        full_depth = min(self.heads.num_heads, self.cfg.max_nodes - 1)
        full = self.draft_s[full_depth]
        seen = self.plain_extra_s is not None and self.tree_extra_s is not None
        tree_work = max(self.tree_extra_s - self.plain_extra_s, 0.0) if seen else 0.0
        out = [0.0]
        for n in range(2, self.cfg.max_nodes + 1):
            d = min(n - 1, full_depth)
            # Never above the full tree's (refreshed by every probe): a cold first draft at
            # some depth must not keep that depth from being drafted again.
            out.append((min(self.draft_s[d], full) if self.draft_s[d] and full else full * d / full_depth) + tree_work)
        return out

    def note_pass(self, batch: int, nodes: int, seconds: float) -> None:
        """Cost model: EMA of a step's seconds after drafting beyond its profiled forward, apart
        for plain steps (nodes = 1) and tree steps."""
        extra = seconds - self.profile.latency(batch, nodes)
        old = self.plain_extra_s if nodes == 1 else self.tree_extra_s
        new = extra if old is None else COST_MODEL_MOMENTUM * old + (1 - COST_MODEL_MOMENTUM) * extra
        if nodes == 1:
            self.plain_extra_s = new
        else:
            self.tree_extra_s = new

    def note_drafted(self, cands, drafts: int, seconds: float) -> None:
        """Update the cost model's EMAs of drafting time and of expected tokens per row (one
        step's drafts say little about the next ones: confidence varies per token)."""
        m = COST_MODEL_MOMENTUM
        depth = min(drafts, self.heads.num_heads)
        old = self.draft_s[depth]
        # The first, or after a cold start: averaging would keep it high for long.
        self.draft_s[depth] = seconds if not old or seconds < old / 2 else m * old + (1 - m) * seconds
        # Kept on the host (this step reads its drafts anyway), so planning a step never syncs.
        expected = cands.expected_tokens(drafts + 1).mean(dim=0).cpu()
        if self.expected_per_row is None:
            self.expected_per_row, self.typical_per_row = expected, expected
        else:
            self.expected_per_row = blend(self.expected_per_row, expected, m)
            self.typical_per_row = blend(self.typical_per_row, expected, TYPICAL_MOMENTUM)
        self.steps_since_full_draft = 0 if drafts == self.cfg.max_nodes - 1 else self.steps_since_full_draft + 1

    def update_calibration(self, verdict, live: torch.Tensor) -> None:
        """Per depth: EMA of accepted rate vs the head mass drafted under the reached node, over live rows."""
        self.observed, self.predicted = calibrated(self.observed, self.predicted, verdict, live,
                                                   self.cfg.calibration_momentum)

    def record(self, verdict, budget: int, live: torch.Tensor, on_chain: torch.Tensor | None) -> None:
        """on_chain [B, depth]: emitted tokens that the context lookup chain held (None: no chain)."""
        self.stats["verify_steps"] += 1
        self.stats["budget_per_step"].append(budget)
        if budget > 1:  # a plain step's one token per live row is counted in step
            self.pass_counts.add_pass(verdict.counts, live, verdict.accepted_at_depth, on_chain)


def node_bucket(nodes: int, max_nodes: int) -> int:
    """Nodes a verify forward runs with for a tree of `nodes` (root included): the next power of two."""
    return min(1 << (nodes - 1).bit_length(), max_nodes)


def sync_free_bucket(nodes: int, max_nodes: int) -> int:
    """The node bucket of a sync-free tree of `nodes`: trees of 2 verify in the 4-node bucket, as a
    dimension of size 1 would be a graph of its own."""
    return node_bucket(max(nodes, 4), max_nodes)


def filler_state(model, cache: KVCache, batch: int, cached: int, history_slots: int) -> DecodeState:
    """A decode state of `batch` rows of `cached` tokens each, in `cache` (its lengths set) and in
    histories of `history_slots`, to compile or time steps on."""
    device = next(model.parameters()).device
    history = TokenHistory.from_prompts([[0] * cached] * batch, history_slots, device)
    cache.lengths.fill_(cached)
    last_hidden = torch.zeros(batch, model.config.hidden_size, device=device, dtype=next(model.parameters()).dtype)
    return DecodeState(cache, history, torch.arange(batch, device=device), RowRandom(0, list(range(batch)), device),
                       torch.zeros(batch, dtype=torch.long, device=device), last_hidden, SamplingParams())


def tree_forward(form: str, model, ids: torch.Tensor, positions: torch.Tensor, cache, mask: torch.Tensor,
                 span: int):
    """The verify forward at a fixed shape: logits and hidden states [B, nodes, ...] of every node.
    `form`: `model.form` (see `specialise`)."""
    specialise(form)
    out = model(ids, position_ids=positions, cache=cache, new_token_mask=mask, span=span)
    return out.logits, out.hidden


def verify_pass_stats(s: dict, counts: dict) -> dict:
    """The stats keys every tree decoder reports, from its step counters `s` and `PassCounts.read()`."""
    hist = counts["tokens_per_step_hist"]
    emitted = sum(k * v for k, v in hist.items())
    return {
        "verify_steps": s["verify_steps"],
        "tokens_per_step_hist": hist,
        "drafted_response_steps": counts["drafted_response_steps"],
        "drafted_tokens": counts["drafted_tokens"],
        "tokens_per_step_mean": emitted / max(sum(hist.values()), 1),
        "acceptance_by_depth": [a / r if r else 0.0 for a, r in zip(counts["accepted_by_depth"], counts["reached_by_depth"])],
        "budget_per_step": s["budget_per_step"],
        "time_draft_s": s["time_draft_s"],
        "time_verify_s": s["time_verify_s"],
        "time_bookkeeping_s": s["time_bookkeeping_s"],
    }


def blend(average: torch.Tensor, observed: torch.Tensor, momentum: float) -> torch.Tensor:
    """EMA step of expected tokens per tree size where `observed` covers only the smaller
    trees (a step drafted for its planned tree): the larger trees' estimates move by as much
    as the largest observed one, so a plan can grow as confidence rises without a probe."""
    covered = min(len(observed), len(average))
    head = momentum * average[:covered] + (1 - momentum) * observed[:covered]
    return torch.cat((head, average[covered:] + (head[-1] - average[covered - 1])))
