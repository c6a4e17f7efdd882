"""Typed statistics of a generate call: the engine's, and a tree decoder's verify passes within it.

Plain dataclasses, so rollout actors return them through Ray. A tree decoder's per-step list
lines up with the engine's `active_rows_per_step` (see `without_idle_steps`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class CompileStats:
    """Graphs compiled by step functions, and the seconds of the calls that compiled them."""

    compile_s: float = 0.0  # wall time of the calls that compiled (tracing, codegen, the first run)
    compiles: int = 0  # graphs compiled

    def __add__(self, other: CompileStats) -> CompileStats:
        return CompileStats(self.compile_s + other.compile_s, self.compiles + other.compiles)


@dataclass
class ReflexStats:
    """Reflex's fast path in one generate call (`speculation.adaptation` reflex, both, every_step)."""

    on_share: float  # share of verify steps that drafted with the correction injected
    records: int  # matured records fed into the rows' fast states
    reliability: float  # rows' mean reliability, averaged over verify steps
    state_rms: float  # rows' mean fast-state RMS, averaged over verify steps
    resets: int  # fast states reset by a feedback blow-up
    guard_trips: int  # times the safety guard switched injection off, over the decoder's life so far
    time_s: float  # seconds spent feeding matured records into the fast states


@dataclass
class TreeStats:
    """A tree decoder's verify steps in one generate call (plain steps of a tree decoder included)."""

    verify_steps: int  # steps that had a live row
    budget_per_step: list[int]  # nodes per row (root included) of each of them; 1: a plain step
    tokens_per_step_hist: dict[int, int]  # live row-steps by the tokens their responses kept (plain ones under 1)
    tokens_per_step_mean: float  # tokens a live row's response kept per step
    drafted_response_steps: int  # live row-steps that verified a tree
    drafted_tokens: int  # tokens those row-steps' responses kept
    acceptance_by_depth: list[float]  # accepted share of the drafts that reached each depth
    lookup_token_share: float  # share of accepted drafts that the context lookup chain held
    time_draft_s: float  # drafting and choosing each tree
    time_verify_s: float  # the verify forward and the acceptance rule
    time_bookkeeping_s: float  # learning from each pass (calibration, counts, Reflex, head records)
    time_records_s: float = 0.0  # of the bookkeeping, collecting the slow path's head records
    reflex: ReflexStats | None = None  # None: Reflex off
    # Would-be trees scored while decoding plain (speculation/verification/would_be.py).
    would_be_nodes: int = 0  # their nodes per response (root included); 0: none scored
    would_be_passes: int = 0  # trees scored to the end
    would_be_tokens: float = 0.0  # tokens those would have emitted, one verify pass each
    time_would_be_s: float = 0.0  # drafting and starting them
    tree_step_cost: float | None = None  # a tree step of would_be_nodes, in plain steps, by the profile (None: none)

    @property
    def would_be_tokens_per_step(self) -> float | None:
        """Tokens a would-be tree would have emitted per verify pass; None where none was scored."""
        return self.would_be_tokens / self.would_be_passes if self.would_be_passes else None


@dataclass
class DecoderStats:
    """What a decoder reports when a generate call ends."""

    compiled: CompileStats  # its step functions' compiles during the call
    tree: TreeStats | None = None  # a tree decoder's verify steps; None for plain decoding


@dataclass
class GenerationStats:
    """One `RolloutEngine.generate` call."""

    steps: int  # decode steps that had a live row (the prefill samples each row's first token)
    active_rows_per_step: list[int]  # live rows at each of those steps
    tokens: int  # response tokens returned
    wall_time_s: float  # the whole call
    prefill_s: float  # of it, the prompts' forward and the first tokens
    tokens_per_s: float  # tokens / wall_time_s
    compile_s: float = 0.0  # of it, calls that compiled a graph (the decoder's steps, the bookkeeping)
    compiles: int = 0  # graphs compiled during the call
    tree: TreeStats | None = None  # a tree decoder's verify steps; None for plain decoding


def without_idle_steps(tree: TreeStats | None, rows_per_step: list[int]) -> TreeStats | None:
    """A tree decoder's stats without the steps that ran after every row had finished (sync-free
    steps before the next read emit nothing), so its per-step list lines up with `active_rows_per_step`."""
    if tree is None:
        return None
    budgets = [b for b, rows in zip(tree.budget_per_step, rows_per_step) if rows]
    return replace(tree, budget_per_step=budgets, verify_steps=len(budgets))
