"""What a decoding step works on and returns: the rows of a generate call, and each step's emissions.

Rows stay in cache order; the attended span grows in SPAN_BUCKET steps so that compiled steps
meet few shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models import KVCache
from .sampling import RowRandom, SamplingParams
from .token_history import TokenHistory


@dataclass
class StepResult:
    """What one decoding step emitted for each active row (padded to the longest)."""

    tokens: torch.Tensor  # [B, K] emitted tokens
    logprobs: torch.Tensor  # [B, K]
    counts: torch.Tensor  # [B] how many of the K are real


# The attended span grows in steps of this many cache slots: few shapes, little padding.
SPAN_BUCKET = 64


class DecodeState:
    """Per-row state of a generate call; rows are kept in cache order.

    Sync-free steps (plain ones, and sync-free tree steps) leave finished rows in the
    batch (`live` False, emitting nothing) until the engine compacts it at a batch-size bucket,
    so no step needs to read on the host which rows are done.
    """

    def __init__(self, cache: KVCache, history: TokenHistory, row_ids: torch.Tensor, rng: RowRandom,
                 last_tokens: torch.Tensor, last_hidden: torch.Tensor, params: SamplingParams):
        self.cache = cache
        self.history = history  # prompt + emitted ids per row (the last one is last_tokens)
        self.prompt_lengths = history.lengths.clone()  # made before any response token is appended
        self.row_ids = row_ids  # output index of each cache row
        self.rng = rng
        self.last_tokens = last_tokens  # sampled but not yet in the cache
        self.last_hidden = last_hidden  # final hidden state at the position that produced it
        self.params = params
        self.live = torch.ones_like(row_ids, dtype=torch.bool)  # rows still generating
        self.live_rows = len(row_ids)  # rows not finished at the last host read (the engine's)
        # Host-side bound on every row's cache length, kept by the decoders without a sync.
        self.cached_bound = int(history.lengths.max())
        self.drafter_state = None  # per-row state a drafter keeps for the generate call (Reflex), with keep(rows)

    @property
    def batch_size(self) -> int:
        return self.row_ids.shape[0]

    def span(self, num_new: int) -> int:
        """Cache slots a step of `num_new` tokens per row attends to: the bound on the longest
        row plus the new tokens, rounded up to a SPAN_BUCKET multiple (a fixed shape)."""
        return span_bucket(self.cached_bound + num_new, self.cache.max_len)

    def read_live(self) -> torch.Tensor:
        """Which rows are live, as a host tensor, in the one host read of a bookkeeping point;
        the longest row's cache length, read with it, tightens `cached_bound`."""
        batch = self.batch_size
        read = torch.cat((self.live.long(), self.cache.lengths[:batch].max()[None])).cpu()
        live, self.cached_bound = read[:batch].bool(), int(read[batch])
        self.live_rows = int(live.sum())
        return live

    def keep(self, rows: torch.Tensor) -> None:
        self.cache.keep_rows(rows)
        self.cached_bound = int(self.cache.lengths[: len(rows)].max())  # compaction reads anyway: tighten the bound
        self.history.keep(rows)
        self.prompt_lengths = self.prompt_lengths[rows]
        self.row_ids = self.row_ids[rows]
        self.last_tokens = self.last_tokens[rows]
        self.last_hidden = self.last_hidden[rows]
        self.live = self.live[rows]
        self.rng.keep(rows)
        if self.drafter_state is not None:
            self.drafter_state.keep(rows)


def span_bucket(need: int, max_len: int) -> int:
    """`need` cache slots rounded up to a SPAN_BUCKET multiple, below `max_len`: a compiled step
    recompiles for a span that fills the cache, and only finished rows, whose outputs are dropped,
    can run past the last bucket (a tree accepted beyond a row's cap; see cache_shape)."""
    return min(-(-need // SPAN_BUCKET) * SPAN_BUCKET, max_len - 1)


def cache_shape(rows: int, need: int) -> tuple[int, int]:
    """(rows, slots) to allocate for `rows` rows of up to `need` tokens. A compiled step would
    specialise on a batch that fills the cache (torch.compile takes equal sizes for one) and on
    a span that does, and recompile when that stops holding: so one row beyond `rows`, and one
    slot beyond the span bucket that holds `need`."""
    return rows + 1, -(-need // SPAN_BUCKET) * SPAN_BUCKET + 1
