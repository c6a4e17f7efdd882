"""What a tree decoder's verify passes emitted, counted on the device and read once per generate call.

A step that read its own statistics on the host (`.tolist()` of its counts) would wait for the
GPU every step; these counters only add on the device, so a tree step can run without a host
read, and `read` turns them into numbers when the call ends.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class PassCounts:
    """Counts over the live rows of every pass, in one vector (`pass_increments` says what each
    entry counts): tokens emitted per row-pass (recounted as those kept by `count_kept`), drafts
    accepted and reached per depth, accepted drafts the context lookup chain held, and the
    row-steps of plain passes (one token each)."""

    def __init__(self, max_tokens: int, max_depth: int, device) -> None:
        self.max_tokens, self.max_depth = max_tokens, max_depth
        self.totals = torch.zeros(max_tokens + 1 + 2 * max_depth + 2, dtype=torch.long, device=device)

    def add_pass(self, counts: torch.Tensor, live: torch.Tensor, accepted_at_depth: torch.Tensor,
                 on_chain: torch.Tensor | None = None) -> None:
        """One tree pass (see `pass_increments`)."""
        self.totals += pass_increments(self.max_tokens, self.max_depth, counts, live, accepted_at_depth, on_chain)

    def count_kept(self, emitted: torch.Tensor, kept: torch.Tensor) -> None:
        """Recount the last pass's row-passes by the tokens their responses kept (`kept` [B]) rather
        than those they emitted (`emitted` [B]): a pass that accepted past a stop token or the length
        cap emitted tokens no response holds. Drafts accepted per depth stay as the rule judged them."""
        buckets = self.max_tokens + 1
        self.totals[:buckets] += (F.one_hot(kept, buckets) - F.one_hot(emitted, buckets)).sum(0)

    def add_plain(self, live: torch.Tensor) -> None:
        """One plain pass: every live row emits one token."""
        self.totals[-1] += live.sum()

    def read(self) -> PassTotals:
        """The counts as numbers, in one host read."""
        flat = self.totals.tolist()
        tokens, depth = self.max_tokens + 1, self.max_depth
        by_tokens = flat[:tokens]
        drafted_steps = sum(by_tokens)
        drafted_tokens = sum(k * n for k, n in enumerate(by_tokens))
        hist = {k: n for k, n in enumerate(by_tokens) if n}
        if flat[-1]:
            hist[1] = hist.get(1, 0) + flat[-1]
        return PassTotals(tokens_per_step_hist=dict(sorted(hist.items())), drafted_response_steps=drafted_steps,
                          drafted_tokens=drafted_tokens, drafts_accepted=drafted_tokens - drafted_steps,
                          accepted_by_depth=flat[tokens:tokens + depth],
                          reached_by_depth=flat[tokens + depth:tokens + 2 * depth], lookup_accepted=flat[-2])


@dataclass
class PassTotals:
    """What a generate call's verify passes emitted, over live rows (`PassCounts.read`)."""

    tokens_per_step_hist: dict[int, int]  # row-passes by the tokens their responses kept, plain row-steps under 1
    drafted_response_steps: int  # row-passes of tree passes
    drafted_tokens: int  # tokens those emitted
    drafts_accepted: int  # of those, accepted drafts (each row-pass's last token is not a draft)
    accepted_by_depth: list[int]  # accepted drafts per depth
    reached_by_depth: list[int]  # row-passes whose tree reached each depth
    lookup_accepted: int  # accepted drafts that the context lookup chain held

    @property
    def tokens_per_step_mean(self) -> float:
        emitted = sum(k * v for k, v in self.tokens_per_step_hist.items())
        return emitted / max(sum(self.tokens_per_step_hist.values()), 1)

    @property
    def acceptance_by_depth(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_by_depth, self.reached_by_depth)]

    @property
    def lookup_token_share(self) -> float:
        return self.lookup_accepted / max(sum(self.accepted_by_depth), 1)  # both as the rule judged


def pass_increments(max_tokens: int, max_depth: int, counts: torch.Tensor, live: torch.Tensor,
                    accepted_at_depth: torch.Tensor, on_chain: torch.Tensor | None = None) -> torch.Tensor:
    """What one tree pass adds to `PassCounts.totals`: [row-passes that emitted k = 0..max_tokens
    tokens, accepted drafts per depth, reached depths per depth, accepted drafts on the lookup
    chain, 0 (plain row-steps)]. counts [B] emitted tokens, live [B] rows still generating
    (finished rows wait in a sync-free batch and count for nothing), accepted_at_depth [B, d],
    on_chain [B, depth]: emitted tokens the lookup chain held (None: no chain)."""
    live_count = live.long()
    by_tokens = torch.zeros(max_tokens + 1, dtype=torch.long, device=counts.device).index_add(0, counts, live_count)
    acc = accepted_at_depth & live[:, None]
    reached = torch.cat((live[:, None], acc[:, :-1]), 1)
    unreached = torch.zeros(max_depth - acc.shape[1], dtype=torch.long, device=counts.device)
    on_lookup = torch.zeros(1, dtype=torch.long, device=counts.device)
    if on_chain is not None:
        # Of the emitted tokens on the chain, those before the bonus token were accepted drafts.
        as_draft = torch.arange(on_chain.shape[1], device=on_chain.device)[None] < (counts - 1)[:, None]
        on_lookup = (on_chain & as_draft & live[:, None]).sum()[None]
    return torch.cat((by_tokens, acc.sum(0), unreached, reached.sum(0), unreached, on_lookup,
                      torch.zeros_like(on_lookup)))
