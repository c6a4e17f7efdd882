"""Reflex within a speculative decoder's step: each row's fast state, the correction it injects
into drafting, what each verify pass feeds it, the safety guard, and a generate call's statistics
(the method itself is in `reflex`)."""
from __future__ import annotations

import time
from functools import partial

import torch

from specroll.rollout.decode_state import DecodeState
from specroll.rollout.stats import ReflexStats

from .reflex import FastState, ReflexConfig, SafetyGuard, matured_feedback, rms


class Reflex:
    """Reflex for a policy of `hidden_size` hidden units."""

    def __init__(self, cfg: ReflexConfig, hidden_size: int) -> None:
        self.cfg, self.hidden_size = cfg, hidden_size
        self.guard = SafetyGuard(cfg)
        self.reset_stats()

    def reset_stats(self) -> None:
        self.on_steps = 0  # steps that drafted with the correction injected
        self.records = 0
        self.resets = 0
        self.reliability = 0.0  # sums over verify steps of the rows' mean
        self.state_rms = 0.0
        self.time_s = 0.0

    def fast_state(self, state: DecodeState) -> FastState:
        """Reflex's per-response state, created with the generate call's rows (all at zero)."""
        if state.drafter_state is None:
            state.drafter_state = FastState(len(state.row_ids), self.hidden_size, state.last_hidden.device)
        return state.drafter_state

    def correction(self, state: DecodeState):
        """What drafting adds to the heads' states this step (`FastState.correction`), or None while
        the guard holds injection off or no row's state is active."""
        fast = self.fast_state(state)
        if not (self.guard.allows and bool(fast.active(self.cfg).any())):
            return None
        self.on_steps += 1
        return partial(fast.correction, cfg=self.cfg)

    def learn(self, state: DecodeState, matured, verdict, logprobs: torch.Tensor, lm_head: torch.Tensor,
              draft_vocab: torch.Tensor | None) -> None:
        """Feed the records a pass matured (None: nothing was drafted) into each row's fast state;
        `logprobs`: the pass's sampling log-probs, `lm_head` [V, D] the policy's."""
        started = time.perf_counter()
        fast = self.fast_state(state)
        if matured is not None:
            feedback = matured_feedback(matured, logprobs, lm_head, self.cfg, draft_vocab)
        else:
            feedback = FastState.no_feedback(verdict.counts.shape[0], self.hidden_size, verdict.counts.device)
        resets = fast.resets
        fast.update(feedback, verdict.counts, self.cfg)
        self.records += int(feedback.records.sum())
        self.resets += fast.resets - resets
        self.reliability += float(fast.reliability.mean())
        self.state_rms += float(rms(fast.state).mean())
        self.time_s += time.perf_counter() - started

    def pop_stats(self, tokens_per_step_mean: float, verify_steps: int) -> ReflexStats:
        """The generate call's stats, which ends here: the guard judges it by its accepted length."""
        self.guard.end_rollout(tokens_per_step_mean)
        steps = max(verify_steps, 1)
        out = ReflexStats(on_share=self.on_steps / steps, records=self.records, reliability=self.reliability / steps,
                          state_rms=self.state_rms / steps, resets=self.resets, guard_trips=self.guard.trips,
                          time_s=self.time_s)
        self.reset_stats()
        return out
