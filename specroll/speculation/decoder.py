"""Speculative decoding: a sparse draft tree per response, all trees verified in one pass.

Plugs into `RolloutEngine` like the plain decoder (`rollout.decoder.Decoder`): it feeds each row's
last sampled token (the root) plus its draft tree, and returns the accepted tokens and the bonus
token. The step itself, draft -> verify -> judge -> learn, is `speculation/step.py`; this decoder
sizes each step's tree (its node budget), keeps the drafters' running estimates (`estimates`)
and the step counts between steps, and adds what a step that reads on the host learns besides
(Reflex, the slow path's records, sibling and history lookup). Where the budget decodes plain,
would-be trees are scored against the emitted tokens (`verification.would_be`).
"""
from __future__ import annotations

import time
import warnings

import torch

from specroll.rollout.compiled_step import StepFunction
from specroll.rollout.decode_state import DecodeState, StepResult
from specroll.rollout.decoder import DecoderCheckpoint, prepare_for_decoding
from specroll.rollout.plain_decoder import PlainDecoder
from specroll.rollout.sampling import SamplingParams
from specroll.rollout.stats import CompileStats, DecoderStats

from .adaptation.head_records import HeadRecords, RecordCollector
from .adaptation.maturation import matured_proposals
from .adaptation.reflex_step import Reflex
from .budgets.cost_model import CostModel
from .budgets.policies import concurrency_budget, resolve_budget
from .budgets.tree_gate import TreeGate
from .config import SpeculationConfig
from .drafting.heads import HorizonHeads, shipped_heads
from .drafting.heads_state import HeadsState
from .drafting.reading import node_draws
from .drafting.suffix_drafts import SuffixDrafts
from .estimates import RunningEstimates
from .step import (
    Drafts,
    DraftedTree,
    Judged,
    Learned,
    StepSettings,
    SyncFreeTreeStep,
    candidates,
    drafted_tree,
    learn,
    runs_sync_free_trees,
    step_settings,
    sync_free_bucket,
    sync_free_buckets,
    tree_forward,
    verify_and_judge,
)
from .verification.pass_counts import PassCounts
from .verification.pass_stats import StepLog, tree_stats
from .verification.verify import Verdict, verify_tree
from .verification.would_be import WouldBeTrees
from .verification.would_be_step import scored_would_be, start_would_be
from .warmup import compile_steps, decoder_profile


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


class SpeculativeDecoder:
    """Speculative decoding with `cfg`'s heads, tree and node budget; `heads` replaces the
    configured ones, `compile` compiles the steps (and profiles them compiled)."""

    def __init__(self, model, cfg: SpeculationConfig, heads: HorizonHeads | None = None, compile: bool = False) -> None:
        prepare_for_decoding(model)
        self.model, self.cfg, self.compiled = model, cfg, compile
        self.plain = PlainDecoder(model, compile)  # the step where no tree is verified
        device = next(model.parameters()).device
        self.verify_forward = StepFunction(tree_forward, compile, device)
        # The acceptance rule; exactness tests swap in a deliberately biased one as a negative control.
        self.verify = verify_tree
        self.max_tokens_per_step = cfg.max_nodes
        self.heads: HorizonHeads | None = None
        self.gate: TreeGate | None = None  # set once the profile is known
        self.cost_model: CostModel | None = None  # the same
        self.reflex = Reflex(cfg.reflex, model.config.hidden_size) if cfg.uses_reflex else None
        self.would_be: WouldBeTrees | None = None  # set with the heads (trees as deep as they draft)
        self.plain_steps_since_would_be = 0
        heads = heads if heads is not None else initial_heads(model, cfg)
        # The sibling and history sources; the history outlives generate calls (`learn_from_responses`).
        self.suffix = (SuffixDrafts(cfg.sibling_lookup, cfg.history_lookup, cfg.lookup_ngram,
                                    cfg.history_tokens_per_prompt, cfg.history_tokens, cfg.calibration_momentum,
                                    cfg.tree_depth(heads.num_heads), device)
                       if cfg.sibling_lookup or cfg.history_lookup else None)
        self.records = (RecordCollector(heads.num_heads, cfg.drift.depth_buckets, cfg.records_per_rollout,
                                        record_nodes=cfg.record_nodes) if cfg.uses_slow_path else None)
        self.set_heads(heads)
        self.budget = resolve_budget(cfg.budget, device.type)
        sync_free = runs_sync_free_trees(cfg, device.type, self.budget)
        self.sync_free = (SyncFreeTreeStep(cfg, sync_free_buckets(cfg, self.budget), self.verify_forward, compile,
                                           device) if sync_free else None)
        self.min_rows = self.plain.min_rows if sync_free else 1  # steps that read compact to live rows
        self.compiled_on_cuda = self.plain.compiled_on_cuda  # steps replay CUDA graphs: the engine's cache stays put
        if compile:
            compile_steps(self)
        measured = self.budget == "cost_model" or (self.budget == "concurrency" and cfg.capacity is None)
        self.profile = decoder_profile(self, compile) if measured else None
        self.capacity = cfg.capacity or (self.profile.capacity if self.profile else 1)
        # Trees sized by a measured capacity run only where they pay; a capacity set by hand, or
        # min_nodes above 1, sizes them alone.
        if self.budget == "concurrency" and self.profile is not None and self.profile.tree_steps and cfg.min_nodes == 1:
            self.gate = TreeGate(self.sync_free.buckets, cfg.max_nodes, cfg.min_gain, device)
        if self.budget == "cost_model":
            self.cost_model = CostModel(self.profile, self.depth, cfg.min_nodes, cfg.max_nodes, cfg.min_gain)
        self.start_running_estimates()  # outside inference mode, as set_heads; warm-ups and profiles taught nothing

    @property
    def depth(self) -> int:
        """How deep this decoder's trees draft (`SpeculationConfig.tree_depth` of its heads): what
        every structure sized by depth is sized by, and resized by when heads are set."""
        return self.cfg.tree_depth(self.heads.num_heads)

    def set_heads(self, heads: HorizonHeads) -> None:
        """Use `heads` from the next step on (call between generate calls). A later version of the
        heads drafting now (a slow-path update) keeps the running estimates of how well they
        draft, which a small update barely moves, and probes a closed tree gate at its first
        interval again; other heads start them afresh, sized by their depth (refused, leaving the
        decoder as it was, where `speculation.max_depth` is deeper than they draft)."""
        self.cfg.tree_depth(heads.num_heads)  # refused before anything changes
        updated = self.heads is not None and heads.num_heads == self.heads.num_heads and heads.version > self.heads.version
        self.heads = heads.eval().use_prepacked_linears()
        if not updated:
            self.start_running_estimates()
        elif self.gate is not None:
            self.gate.heads_updated()

    def start_running_estimates(self) -> None:
        """The heads' calibration, the cost model's and the lookup's estimates at their priors."""
        device, depth, cfg = next(self.model.parameters()).device, self.depth, self.cfg
        self.would_be = WouldBeTrees(cfg.fixed_nodes, depth, device) if cfg.scores_would_be else None
        self.estimates = RunningEstimates(cfg, depth, device)
        if self.cost_model is not None:
            self.cost_model.restart(depth)
        if self.gate is not None:
            self.gate.reset()
        if self.suffix is not None:
            self.suffix.restart_estimates(depth, self.cfg.calibration_momentum)
        if self.records is not None:
            self.records.follow_heads(self.heads.num_heads)
        self.reset_stats()  # counters per depth of these heads

    def reset_stats(self) -> None:
        self.pass_counts = PassCounts(self.cfg.max_nodes, self.depth, next(self.model.parameters()).device)
        self.step_log = StepLog()
        if self.would_be is not None:
            self.would_be.reset()  # the next call's rows are other rows
        if self.reflex is not None:
            self.reflex.reset_stats()

    def count_kept(self, emitted: torch.Tensor, kept: torch.Tensor) -> None:
        """The pass counts count the tokens the responses kept (see `Decoder.count_kept`); a plain
        step's one token is always kept, so plain steps add no work here."""
        if self.step_log.budget_per_step and self.step_log.budget_per_step[-1] > 1:
            self.pass_counts.count_kept(emitted, kept)

    def pop_stats(self) -> DecoderStats:
        totals = self.pass_counts.read()
        if self.gate is not None:
            self.gate.read()  # the call's last trees, read with its counts
        steps = self.step_log.verify_steps
        reflex = None if self.reflex is None else self.reflex.pop_stats(totals.tokens_per_step_mean, steps)
        if self.would_be is not None:
            by_size, self.step_log.would_be_passes = self.would_be.pop_sums()
            self.step_log.would_be_tokens, self.step_log.would_be_nodes = by_size[-1], self.would_be.nodes
        out = DecoderStats(self.compile_stats(), tree_stats(self.step_log, totals, reflex))
        self.reset_stats()
        return out

    def compile_stats(self) -> CompileStats:
        """Graphs compiled since the last pop (of every step function) and their seconds."""
        compiles = [self.plain.pop_stats().compiled, self.verify_forward.pop()]
        return sum(compiles + (self.sync_free.pop_compiles() if self.sync_free is not None else []), CompileStats())

    def pop_head_records(self) -> HeadRecords | None:
        """Slow path: (HeadTelemetry, MaturedRecords or None) of the generate calls since the last pop;
        None when `speculation.adaptation` has no slow path."""
        return None if self.records is None else self.records.pop()

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

    def planned_step_drafts(self, live_rows: int) -> int:
        """Nodes the next step drafts for `live_rows` unfinished rows (0: a plain step), decided
        on the host alone."""
        if self.cost_model is not None:
            return self.cost_model.planned_drafts(live_rows)
        return self.node_budget(live_rows) - 1

    def next_step_sync_free(self, state: DecodeState) -> bool:
        """Whether the next step reads nothing on the host (a plain step always, a sync-free tree
        step but for the tree gate's counts every `tree_gate.READ_EVERY` steps)."""
        return self.sync_free is not None or self.planned_step_drafts(state.live_rows) == 0

    def settings(self, drafts: int, params: SamplingParams) -> StepSettings:
        """What a step drafting `drafts` candidates per depth, sampling by `params`, reads besides tensors."""
        return step_settings(self.cfg, drafts, self.depth, self.estimates.lookup_acceptance.momentum, params)

    @torch.inference_mode()
    def step(self, state: DecodeState) -> StepResult:
        """One decode step of every row (speculation/step.py): draft a tree (or none), verify and
        judge it in one pass (or take the plain step), then learn from the verdict. Where trees run
        without host reads, one sync-free tree step instead."""
        if self.sync_free is not None and (budget := self.node_budget(state.live_rows)) > 1:
            return scored_would_be(self, state, self.sync_free_tree_step(state, budget))
        t0 = time.perf_counter()
        batch = state.last_tokens.shape[0]  # finished rows included before a sync-free step
        drafted = self.drafted_tree(state)
        t1 = time.perf_counter()
        judged = (verify_and_judge(self.verify_forward, self.model, self.verify, state, drafted, self.cfg.max_nodes,
                                   self.depth) if drafted.budget > 1 else None)
        verdict = judged.verdict if judged is not None else self.plain_pass(state)
        t2 = time.perf_counter()
        self.learn_from_pass(state, drafted, verdict, judged)
        ended = time.perf_counter()
        self.step_log.time_draft_s += t1 - t0
        self.step_log.time_verify_s += t2 - t1
        self.step_log.time_bookkeeping_s += ended - t2
        if self.cost_model is not None:
            self.cost_model.note_pass(batch, drafted.budget, ended - t1)
        return scored_would_be(self, state, StepResult(verdict.tokens, verdict.logprobs, verdict.counts))

    def drafted_tree(self, state: DecodeState) -> DraftedTree:
        """Draft (step 1): this step's drafts and the tree it verifies, sized by the node budget (1: a plain step)."""
        started = time.perf_counter()
        planned = self.planned_step_drafts(state.live_rows)
        budget = 1 if planned == 0 else planned + 1
        drafts = self.draft(state, planned) if planned > 0 else None
        cands = None if drafts is None else drafts.candidates
        if self.cost_model is not None:  # it planned the drafts; they pick N_t
            budget = self.cost_model.drafted(cands, planned, state.last_tokens.shape[0], time.perf_counter() - started)
        if budget == 1:
            self.pass_counts.add_plain(state.live)  # finished rows emit nothing
            if self.gate is not None:
                self.gate.note_plain()
            if self.would_be is not None:  # drafts as deep as a would-be tree's serve as one
                start_would_be(self, state, cands if planned >= self.cfg.fixed_nodes - 1 else None)
        return drafted_tree(budget, drafts, state.last_tokens, state.last_hidden)

    def draft(self, state: DecodeState, max_drafts: int) -> Drafts:
        """The step's candidates (`step.candidates`) with Reflex's correction and sketches where on,
        and each row's context lookup chain and its sibling and history chains (None where off)."""
        suffix = None if self.suffix is None else self.suffix.chains(state, min(self.depth, max_drafts))
        sketch = self.cfg.reflex.sketch_size if self.reflex is not None or self.records is not None else 0
        # Reflex corrects the heads' states: asked only where the heads draft.
        adjust = self.reflex.correction(state) if self.reflex is not None and self.cfg.head_drafts else None
        settings = self.settings(max_drafts, state.params)
        draws = node_draws(state.rng.keys, state.rng.counters, self.depth) if settings.reading is not None else None
        est = self.estimates
        cands, lookup = candidates(self.heads, self.model, state.last_tokens, state.last_hidden, est.calibration(),
                                   state.history.tokens, state.history.lengths, est.lookup_rate(), settings, adjust,
                                   sketch, self.cfg.head_drafts, () if suffix is None else self.suffix.scored(suffix),
                                   draws, est.reading_rate)
        return Drafts(cands, lookup, suffix)

    def plain_pass(self, state: DecodeState) -> Verdict:
        """A root-only step is the plain decode step (compiled where that is on), so a step that
        does not speculate costs what plain decoding does; its verdict accepts nothing."""
        step = self.plain.step(state)
        if self.plain.compiled_on_cuda:
            # Copied, as judging copies its own: the next step reads it (drafting, head records) after a
            # CUDA graph begins a new step, which may replay over the plain step's outputs.
            state.last_hidden = state.last_hidden.clone()
        return Verdict.of_plain_step(step)

    def learn_from_pass(self, state: DecodeState, drafted: DraftedTree, verdict: Verdict, judged: Judged | None) -> None:
        """Learn (step 4) from a pass (`judged`: None after a plain step): the heads' calibration, the
        lookup chains' acceptance, the pass counts, and where on, Reflex's fast state and the slow
        path's head records."""
        budget, cands, tree, est = drafted.budget, drafted.candidates, drafted.tree, self.estimates
        emitted = verdict.counts * state.live  # finished rows waiting in the batch emit nothing
        if judged is not None:
            self.keep_learned(learn(verdict, tree, state.live, est.observed, est.predicted, est.lookup_rate(),
                                    drafted.lookup, est.reading_rate, self.settings(budget - 1, state.params)))
        elif drafted.lookup is not None:  # drafted, then decoded plain: the emitted token still says how the chain did
            est.lookup_acceptance.update(drafted.lookup, verdict.tokens, emitted)
        if drafted.suffix is not None:
            self.suffix.learn(drafted.suffix, verdict.tokens, emitted)
        self.step_log.budget_per_step.append(budget)
        matured = matured_proposals(cands.proposals, tree, verdict) if budget > 1 and cands.proposals else None
        if self.reflex is not None:
            logprobs = None if judged is None else judged.logprobs
            self.reflex.learn(state, matured, verdict, logprobs, self.model.lm_head.weight, self.heads.draft_vocab)
        if self.records is not None and matured is not None:
            started = time.perf_counter()
            self.records.add_pass(matured, judged.logits, verdict, tree, drafted.hidden, drafted.roots,
                                  state.history.lengths - state.prompt_lengths, state.row_ids, self.heads.version,
                                  proposals=cands.proposals, draft_vocab=self.heads.draft_vocab)
            self.step_log.time_records_s += time.perf_counter() - started

    def keep_learned(self, learned: Learned) -> None:
        """Keep what a tree pass taught (`step.learn`) as the decoder's running estimates and counts."""
        self.estimates.keep(learned)
        self.pass_counts.totals += learned.pass_increments

    def sync_free_tree_step(self, state: DecodeState, budget: int) -> StepResult:
        """A sync-free tree step of `budget` nodes (the tree gate reads its counts every READ_EVERY
        steps), then what it taught: the calibration, the lookup chain's acceptance, the counts."""
        est = self.estimates
        ran = self.sync_free(self.model, self.heads, self.verify, state, budget, est.observed, est.predicted,
                             est.lookup_rate(), est.reading_rate, self.settings(self.sync_free.drafts, state.params))
        judged = ran.judged
        self.keep_learned(judged.learned)
        if self.gate is not None:
            self.gate.note_tree(ran.nodes, judged.learned.pass_increments[: self.max_tokens_per_step + 1])
        self.step_log.budget_per_step.append(budget)
        self.step_log.time_draft_s += ran.draft_s
        self.step_log.time_verify_s += ran.verify_s
        return StepResult(judged.tokens, judged.logprobs, judged.counts)

    # What the rollout actor asks of a decoder beyond its steps (`specroll.decoders.RolloutDecoder`).
    @property
    def heads_version(self) -> int:
        return self.heads.version

    def heads_state(self) -> HeadsState:
        return HeadsState.of(self.heads)

    def load_heads(self, heads: HeadsState) -> int:
        """Draft with `heads` from the next generate call on, unless they are older than its own."""
        if heads.version >= self.heads.version:
            self.set_heads(heads.applied_to(self.heads))
        return self.heads.version

    def learn_from_responses(self, prompts: list[list[int]], responses: list[list[int]], group_size: int) -> None:
        """Keep a generate call's responses (prompt-major, `group_size` per prompt) for history
        lookup (nothing when it is off)."""
        if self.suffix is not None:
            self.suffix.remember(prompts, responses, group_size)

    def pop_drafter_update(self) -> None:
        return None  # its heads learn on the slow path, from `pop_head_records`

    def checkpoint_state(self) -> DecoderCheckpoint:
        return DecoderCheckpoint(draft_history=None if self.suffix is None else self.suffix.history_state())

    def load_checkpoint_state(self, state: DecoderCheckpoint) -> None:
        if state.draft_history is not None and self.cfg.history_lookup:
            self.suffix.load_history_state(state.draft_history)
