"""A tree decoder's statistics of a generate call: what it noted on the host of each step, and
its device counts (`pass_counts`), as the engine's `TreeStats` (the speculative and the FastGRPO
decoder report alike)."""
from __future__ import annotations

from dataclasses import dataclass, field

from specroll.rollout.stats import ReflexStats, TreeStats

from .pass_counts import PassTotals


@dataclass
class StepLog:
    """What a tree decoder notes on the host of each step of a generate call."""

    budget_per_step: list[int] = field(default_factory=list)  # nodes per row (root included); 1: a plain step
    time_draft_s: float = 0.0  # drafting and choosing each tree
    time_verify_s: float = 0.0  # the verify forward and the acceptance rule
    time_bookkeeping_s: float = 0.0  # learning from each pass
    time_records_s: float = 0.0  # of the bookkeeping, collecting head records
    time_would_be_s: float = 0.0  # drafting and starting would-be trees before plain steps
    would_be_nodes: int = 0  # nodes (root included) of the would-be trees; 0: none scored
    would_be_passes: int = 0  # would-be trees scored to the end
    would_be_tokens: float = 0.0  # tokens they would have emitted
    tree_step_cost_sum: float = 0.0  # a would-be-sized tree step's cost in plain steps, summed over would-be drafts
    tree_step_cost_count: int = 0

    @property
    def verify_steps(self) -> int:
        return len(self.budget_per_step)

    def note_tree_step_cost(self, plain_steps: float) -> None:
        self.tree_step_cost_sum += plain_steps
        self.tree_step_cost_count += 1


def tree_stats(log: StepLog, totals: PassTotals, reflex: ReflexStats | None = None) -> TreeStats:
    """The `TreeStats` of a generate call from its step log and pass totals (and Reflex's, where on)."""
    return TreeStats(verify_steps=log.verify_steps, budget_per_step=log.budget_per_step,
                     tokens_per_step_hist=totals.tokens_per_step_hist, tokens_per_step_mean=totals.tokens_per_step_mean,
                     drafted_response_steps=totals.drafted_response_steps, drafted_tokens=totals.drafted_tokens,
                     acceptance_by_depth=totals.acceptance_by_depth, lookup_token_share=totals.lookup_token_share,
                     time_draft_s=log.time_draft_s, time_verify_s=log.time_verify_s,
                     time_bookkeeping_s=log.time_bookkeeping_s, time_records_s=log.time_records_s, reflex=reflex,
                     would_be_nodes=log.would_be_nodes, would_be_passes=log.would_be_passes,
                     would_be_tokens=log.would_be_tokens, time_would_be_s=log.time_would_be_s,
                     tree_step_cost=(log.tree_step_cost_sum / log.tree_step_cost_count
                                     if log.tree_step_cost_count else None))
