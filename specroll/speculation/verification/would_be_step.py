"""Would-be trees within a speculative decoder's step: drafting one before a plain step, and
scoring it along the emitted tokens (the trees themselves are in `would_be`)."""
from __future__ import annotations

import time

from specroll.rollout.decode_state import DecodeState, StepResult

from ..drafting.tree import Candidates, select_tree
from .would_be import node_ranks


def start_would_be(decoder, state: DecodeState, cands: Candidates | None) -> None:
    """Before a plain step of `decoder` (a SpeculativeDecoder): a would-be tree of `fixed_nodes`
    nodes for the live rows that hold none, from `cands` (this step's drafts), else drafted here
    every `would_be_every` plain steps; what the finished ones carried teaches the cost model (a
    host read: this step drafts)."""
    cfg = decoder.cfg
    decoder.plain_steps_since_would_be += 1
    if cands is None and decoder.plain_steps_since_would_be < cfg.would_be_every:
        return
    started = time.perf_counter()
    drafts = cfg.fixed_nodes - 1
    if cands is None:
        cands = decoder.draft(state, drafts).candidates
    tree = select_tree(cands, drafts)
    decoder.would_be.start(state.row_ids, tree, node_ranks(cands, tree), state.live)
    decoder.plain_steps_since_would_be = 0
    if decoder.profile is not None:
        decoder.step_log.note_tree_step_cost(tree_step_cost(decoder, state.live_rows))
    if decoder.cost_model is not None and (realised := decoder.would_be.pop_fresh()) is not None:
        decoder.cost_model.note_would_be(realised)
    decoder.step_log.time_would_be_s += time.perf_counter() - started


def tree_step_cost(decoder, batch: int) -> float:
    """What a step of `batch` rows with `fixed_nodes`-node trees costs, in plain steps, by the
    decoder's profile (and the cost model's drafting time, where it measures it)."""
    nodes = decoder.cfg.fixed_nodes
    drafting = decoder.cost_model.drafting_s()[nodes - 1] if decoder.cost_model is not None else 0.0
    return (decoder.profile.latency(batch, nodes) + drafting) / decoder.profile.latency(batch, 1)


def scored_would_be(decoder, state: DecodeState, step: StepResult) -> StepResult:
    """Walk the rows' would-be trees along what `step` emitted; the finished ones calibrate the
    heads' probabilities as a verified tree's verdict would."""
    if decoder.would_be is not None:
        done = decoder.would_be.advance(state.row_ids, step.tokens, step.counts * state.live)
        if done is None:
            return step
        decoder.estimates.calibrate(done, done.done, decoder.cfg.calibration_momentum)
    return step
