"""FastGRPO-style speculative decoding step: the drafter's tree, SpecRoll's exact verification.

Plugs into `RolloutEngine` like `SpeculativeDecoder`: each step feeds every row's root (the last
sampled token) plus its draft tree, verifies all trees in one pass and judges them with `speculation.step.judge` (the
same sample-and-match rule, the same tree masks), and returns the accepted tokens and the bonus.

Per step: (1) the drafter's cache catches up on the entries the last pass verified, with the
policy's true features, which also predicts the feature at the root; (2) drafting goes level
by level, the best K nodes of a level (cumulative log-probability) each proposing K children
through the drafter (tree attention over its own cache); (3) the N - 1 best drafted nodes are
the tree; (4) one policy pass verifies it. The policy's features at every response position
are logged for online learning (`pop_training_data`).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from specroll.speculation.budgets.hardware_profile import get_profile
from specroll.speculation.drafting.tree import Candidates, select_tree, tree_attention_mask
from specroll.speculation.step import accepted_width, judge
from specroll.speculation.verification.pass_counts import PassCounts
from specroll.speculation.verification.pass_stats import StepLog, tree_stats
from specroll.speculation.verification.verify import verify_tree

from ..rollout.decode_state import DecodeState, StepResult
from ..rollout.decoder import DecoderCheckpoint, NoHorizonHeads, prepare_for_decoding
from ..rollout.stats import CompileStats, DecoderStats
from .config import FastGRPOConfig
from .drafter import FeatureDrafter, initial_drafter
from .feature_log import DraftSequences, FeatureLog
from .online import DrafterUpdate, OnlineDrafterLearner
from .tree_rule import TreeShape, levels_worth_drafting, nodes_per_response, tree_shape


class DrafterCall:
    """The drafter's state for one generate call (`DecodeState.drafter_state`), rows in cache order."""

    def __init__(self, cache, features: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor,
                 log: FeatureLog | None) -> None:
        self.cache = cache  # the drafter's KV cache over verified entries
        # Entries verified but not yet in the drafter's cache: (h_t, x_{t+1}) for the positions the last pass kept.
        self.features, self.tokens, self.counts = features, tokens, counts  # [B, W, D], [B, W], [B]
        self.log = log
        self.slots = torch.arange(len(counts), device=counts.device)  # each row's slot in `log`

    def keep(self, rows: torch.Tensor) -> None:
        self.cache.keep_rows(rows)
        self.features, self.tokens, self.counts = self.features[rows], self.tokens[rows], self.counts[rows]
        self.slots = self.slots[rows]


class FastGRPODecoder(NoHorizonHeads):
    """The baseline's decoder; its steps run eager and read on the host. `compile` (`rollout.compile`)
    compiles the engine's bookkeeping around them; `drafter` replaces the configured one; `seed` orders
    its online learning's batches."""

    min_rows = 1  # steps that read compact to live rows
    compiled_on_cuda = False

    def __init__(self, model, cfg: FastGRPOConfig, drafter: FeatureDrafter | None = None,
                 compile: bool = False, seed: int = 0) -> None:
        prepare_for_decoding(model)
        self.model, self.cfg, self.compiled, self.seed = model, cfg, compile, seed
        # The acceptance rule; exactness tests swap in a deliberately biased one as a negative control.
        self.verify = verify_tree
        self.capacity = cfg.capacity or get_profile(model, cfg.profile_cache_len).capacity
        self.max_tokens_per_step = max(2, min(self.capacity, cfg.max_nodes))
        self.set_drafter(drafter if drafter is not None else initial_drafter(model, cfg.drafter_path))
        self.last_call: DrafterCall | None = None
        self.online: OnlineDrafterLearner | None = None  # built at its first use (`online_learner`)
        self.update: DrafterUpdate | None = None  # the last online update, until `pop_drafter_update`
        self.reset_stats()

    def set_drafter(self, drafter: FeatureDrafter) -> None:
        """Draft with `drafter` from the next generate call on."""
        self.drafter = drafter.eval().use_prepacked_linears()

    def reset_stats(self) -> None:
        self.pass_counts = PassCounts(self.cfg.max_depth + 1, self.cfg.max_depth, next(self.model.parameters()).device)
        self.step_log = StepLog()

    def count_kept(self, emitted: torch.Tensor, kept: torch.Tensor) -> None:
        self.pass_counts.count_kept(emitted, kept)

    def pop_stats(self) -> DecoderStats:
        """The generate call's stats, as `SpeculativeDecoder.pop_stats` reports them (no context lookup here)."""
        out = DecoderStats(CompileStats(), tree_stats(self.step_log, self.pass_counts.read()))
        self.reset_stats()
        return out

    def next_step_sync_free(self, state: DecodeState) -> bool:
        """Never: every step reads its tree's size and its verdict on the host."""
        return False

    def shape(self, active_rows: int) -> TreeShape:
        c = self.cfg
        return tree_shape(nodes_per_response(self.capacity, active_rows, c.max_nodes), c.min_depth, c.max_depth,
                          c.depth_scale, c.max_width)

    @torch.inference_mode()
    def step(self, state: DecodeState) -> StepResult:
        t0 = time.perf_counter()
        call = self.call_state(state)
        batch = state.last_tokens.shape[0]
        roots, base = state.last_tokens, state.cache.lengths[:batch].clone()  # base: the root's position
        shape = self.shape(batch)
        levels = levels_worth_drafting(shape)
        cands = self.draft(call, self.catch_up(call, base), base, shape, levels)
        tree = select_tree(cands, min(shape.nodes - 1, cands.tokens.shape[1]))
        t1 = time.perf_counter()

        ids = torch.cat((roots[:, None], tree.tokens), dim=1)
        depths = torch.cat((torch.zeros_like(roots[:, None]), tree.depths), 1)
        out = self.model(ids, position_ids=base[:, None] + depths, cache=state.cache,
                         new_token_mask=tree_attention_mask(tree, levels))
        judged = judge(self.verify, tree, out.logits, out.hidden, state.cache, state.live, state.rng.keys,
                       state.rng.counters, state.params, levels, accepted_width(tree.num_drafts + 1, levels))
        verdict, state.last_hidden, state.rng.counters = judged.verdict, judged.last_hidden, judged.counters
        t2 = time.perf_counter()

        width = int(verdict.counts.max())
        path = verdict.path[:, :width]
        kept = torch.gather(out.hidden, 1, path[..., None].expand(-1, -1, out.hidden.shape[-1]))  # [B, W, D]
        # The kept positions' true features, each with the token that followed it, enter the drafter's cache next step.
        call.features, call.tokens, call.counts = kept, verdict.tokens[:, :width], verdict.counts
        if call.log is not None:
            call.log.write(call.slots, base - state.prompt_lengths + 1, kept, verdict.counts)
        self.record(verdict, shape, state.live)
        self.step_log.time_draft_s += t1 - t0
        self.step_log.time_verify_s += t2 - t1
        self.step_log.time_bookkeeping_s += time.perf_counter() - t2
        return StepResult(verdict.tokens, verdict.logprobs, verdict.counts)

    def call_state(self, state: DecodeState) -> DrafterCall:
        """The generate call's drafter state, made at its first step: the prefill's last feature and
        the first sampled token are the first entry."""
        if state.drafter_state is None:
            rows, cfg = len(state.row_ids), self.cfg
            length = state.params.max_new_tokens + cfg.max_depth + 1
            log = None
            if cfg.online.enabled:
                log = FeatureLog(state.row_ids, state.prompt_lengths - 1, length, state.last_hidden)
                log.write(log.slots(), torch.zeros_like(state.prompt_lengths), state.last_hidden[:, None],
                          torch.ones_like(state.prompt_lengths))
            cache = self.drafter.new_cache(rows, length + (cfg.max_depth - 1) * cfg.max_width)
            state.drafter_state = DrafterCall(cache, state.last_hidden[:, None], state.last_tokens[:, None],
                                              torch.ones_like(state.last_tokens), log)
            self.last_call = state.drafter_state
        return state.drafter_state

    def catch_up(self, call: DrafterCall, base: torch.Tensor) -> torch.Tensor:
        """Put the verified entries into the drafter's cache; returns the predicted feature at the root [B, D]."""
        batch, width = call.tokens.shape
        positions = base[:, None] - call.counts[:, None] + torch.arange(width, device=base.device)
        slots = call.cache.append_slots(batch, width)
        causal = torch.ones(width, width, dtype=torch.bool, device=base.device).tril().expand(batch, width, width)
        predicted = self.drafter(call.features, self.model.embed_tokens(call.tokens), positions, call.cache, slots,
                                 call.cache.attention_mask(causal))
        call.cache.commit(call.counts)
        return predicted[torch.arange(batch, device=base.device), call.counts - 1]

    def draft(self, call: DrafterCall, root_feature: torch.Tensor, base: torch.Tensor, shape: TreeShape,
              levels: int) -> Candidates:
        """EAGLE-2 expansion: level 1 is the root's top K; each further level runs the drafter on the
        K best nodes of the last level (cumulative log-probability) and proposes their top K children.
        Each level keeps at most N - 1 candidates: no more of one level can enter the tree."""
        batch, device = root_feature.shape[0], root_feature.device
        logp = torch.log_softmax(self.model.lm_head(root_feature).float(), dim=-1)  # [B, V]
        width = min(shape.width, logp.shape[-1])
        top_lp, top_tok = logp.topk(width, dim=-1)
        tokens, parents, depths, scores = [top_tok], [torch.full_like(top_tok, -1)], [torch.ones_like(top_tok)], [top_lp]
        frontier_ids = torch.arange(width, device=device).expand(batch, -1)
        frontier_tokens, frontier_scores = top_tok, top_lp
        frontier_features = root_feature[:, None].expand(-1, width, -1)  # the feature each frontier node's entry reads
        # Which draft entries (written after the cache's committed ones) each frontier node's entry sees besides itself.
        sees = torch.zeros(batch, width, 0, dtype=torch.bool, device=device)
        written, next_id = 0, width
        for level in range(2, levels + 1):
            count = frontier_tokens.shape[1]
            slots = call.cache.lengths[:batch, None] + written + torch.arange(count, device=device)
            mask = self.tree_mask(call, sees, written, count)
            predicted = self.drafter(frontier_features, self.model.embed_tokens(frontier_tokens),
                                     (base + level - 2)[:, None].expand(-1, count), call.cache, slots, mask)
            logp = torch.log_softmax(self.model.lm_head(predicted).float(), dim=-1)  # [B, F, V]
            top_lp, top_tok = logp.topk(width, dim=-1)  # [B, F, K]
            keep = min(count * width, shape.nodes - 1)
            best, idx = (frontier_scores[..., None] + top_lp).flatten(1).topk(keep, dim=1)
            parent = idx // width  # frontier slot of each kept child
            tokens.append(torch.gather(top_tok.flatten(1), 1, idx))
            parents.append(torch.gather(frontier_ids, 1, parent))
            depths.append(torch.full_like(idx, level))
            scores.append(best)
            # The best kept children (topk sorts them) are the next level's frontier.
            nxt = min(width, keep)
            parent = parent[:, :nxt]
            own = F.one_hot(written + parent, written + count).bool()  # the parent's own entry
            sees = torch.cat((sees, torch.zeros(batch, count, count, dtype=torch.bool, device=device)), dim=2)
            sees = torch.gather(sees, 1, parent[..., None].expand(-1, -1, sees.shape[2])) | own
            frontier_features = torch.gather(predicted, 1, parent[..., None].expand(-1, -1, predicted.shape[-1]))
            frontier_tokens, frontier_scores = tokens[-1][:, :nxt], best[:, :nxt]
            frontier_ids = torch.arange(next_id, next_id + nxt, device=device).expand(batch, -1)
            written, next_id = written + count, next_id + keep
        scores_t = torch.cat(scores, 1)
        return Candidates(torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(depths, 1), scores_t, scores_t.exp())

    @staticmethod
    def tree_mask(call: DrafterCall, sees: torch.Tensor, written: int, count: int) -> torch.Tensor:
        """[B, 1, F, S]: a frontier entry sees the committed cache, its ancestors' draft entries and itself."""
        batch = sees.shape[0]
        lengths = call.cache.lengths[:batch]
        slot = torch.arange(int(lengths.max()) + written + count, device=lengths.device)
        rel = slot[None] - lengths[:, None]  # [B, S]: index among this step's draft entries
        cached = (rel < 0)[:, None, :]
        own = torch.cat((sees, torch.eye(count, dtype=torch.bool, device=sees.device).expand(batch, -1, -1)), dim=2)
        idx = rel.clamp(0, written + count - 1)[:, None, :].expand(-1, count, -1)
        visible = torch.gather(own, 2, idx) & ((rel >= 0) & (rel < written + count))[:, None, :]
        return (cached | visible)[:, None]

    def record(self, verdict, shape: TreeShape, live: torch.Tensor) -> None:
        self.step_log.budget_per_step.append(shape.nodes)
        self.pass_counts.add_pass(verdict.counts, live, verdict.accepted_at_depth)

    def pop_training_data(self, token_ids: list[list[int]]) -> DraftSequences | None:
        """The last generate call's responses (`RolloutOutput.token_ids`) with the policy's features
        at their positions; None if online learning is off or no response has two tokens."""
        call, self.last_call = self.last_call, None
        if call is None or call.log is None:
            return None
        return call.log.sequences(token_ids)

    # What the rollout actor asks of a decoder beyond its steps (`specroll.decoders.RolloutDecoder`).
    def online_learner(self) -> OnlineDrafterLearner | None:
        """Its drafter's online learning, built at the first use; None when `cfg.online` is off."""
        if self.online is None and self.cfg.online.enabled:
            self.online = OnlineDrafterLearner(self.drafter, self.model, self.cfg.online, seed=self.seed)
        return self.online

    def learn_from_responses(self, prompts: list[list[int]], responses: list[list[int]], group_size: int) -> None:
        """Train the drafter online on the call's responses (paid for inside the step, as FastGRPO does)."""
        learner = self.online_learner()
        data = None if learner is None else self.pop_training_data(responses)
        if data is not None:
            self.update = learner.update(data)

    def pop_drafter_update(self) -> DrafterUpdate | None:
        """The online update `learn_from_responses` made; None without one since the last pop."""
        update, self.update = self.update, None
        return update

    def checkpoint_state(self) -> DecoderCheckpoint:
        learner = self.online_learner()
        return DecoderCheckpoint(drafter=None if learner is None else learner.state_dict())

    def load_checkpoint_state(self, state: DecoderCheckpoint) -> None:
        learner = self.online_learner()
        if state.drafter is not None and learner is not None:
            learner.load_state_dict(state.drafter)
