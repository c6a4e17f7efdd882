"""What the engine asks of a decoder: `PlainDecoder`, `SpeculativeDecoder` and `FastGRPODecoder` are decoders.

A decoder runs one step of every row of a generate call and says beforehand whether that step
reads anything on the host; the engine owns the rows, the stop rules and the host reads.
`specroll.decoders.build_decoder` builds the one a rollout config asks for, and
`specroll.decoders.RolloutDecoder` is what the rollout actor asks of it besides; the records
and defaults of that second interface that decoders below it share live here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .decode_state import DecodeState, StepResult
from .stats import DecoderStats


class Decoder(Protocol):
    @property
    def max_tokens_per_step(self) -> int:
        """Most tokens a step appends per row: the slack a KV cache keeps beyond the response cap."""

    @property
    def min_rows(self) -> int:
        """Fewest rows its sync-free steps run with (`plain_decoder.compiled_min_rows`)."""

    @property
    def compiled(self) -> bool:
        """Whether the rollout runs compiled (`rollout.compile`): the engine compiles its bookkeeping too."""

    @property
    def compiled_on_cuda(self) -> bool:
        """Whether its steps replay CUDA graphs: the engine then keeps its KV cache at fixed addresses."""

    def next_step_sync_free(self, state: DecodeState) -> bool:
        """Whether the next step reads nothing on the host, so that it may run without a read before it
        and with finished rows left in the batch."""

    def step(self, state: DecodeState) -> StepResult:
        """One decoding step of every row of `state`."""

    def count_kept(self, emitted: torch.Tensor, kept: torch.Tensor) -> None:
        """Of the tokens its last step emitted per row (`emitted` [B], 0 for finished rows), those the
        responses kept, cut at a stop token or the length cap (`kept` [B]): the tokens its statistics count."""

    def pop_stats(self) -> DecoderStats:
        """The statistics of the generate call that just ended; the next call's start afresh."""


@dataclass(frozen=True)
class DecoderCheckpoint:
    """What a run checkpoint keeps of one rollout actor's decoder, a part per file (one entry per actor)."""

    drafter: dict[str, Any] | None = None  # an online-learnt drafter's weights and optimiser (`drafter.pt`)
    draft_history: dict[str, Any] | None = None  # the earlier responses history lookup keeps (`draft_history.pt`)


class NoHorizonHeads:
    """The head calls of `specroll.decoders.RolloutDecoder` for a decoder that drafts with no horizon
    heads: none to report or load, no records for the slow path."""

    heads_version = None

    def heads_state(self) -> None:
        return None

    def load_heads(self, heads: object) -> int:
        raise ValueError(f"{type(self).__name__} drafts with no horizon heads (rollout.mode is not speculation)")

    def pop_head_records(self) -> None:
        return None


def prepare_for_decoding(model) -> None:
    """Put `model` in eval mode with prepacked weights, which make the few-row products of decoding
    and tree verification cheap on CPU (elsewhere they change nothing). Every decoder does this
    when it is built, before it compiles or times a step."""
    model.eval().use_prepacked_linears()
