"""The plain decoder: one token per row per step, the vanilla baseline (see `decoder.Decoder`)."""
from __future__ import annotations

import torch

from ..models import KVCache
from .compiled_step import StepFunction, specialise
from .decode_state import DecodeState, StepResult
from .decoder import DecoderCheckpoint, NoHorizonHeads, prepare_for_decoding
from .samplers import sample_tokens
from .sampling import SamplingParams, row_uniforms, sampling_logprobs
from .stats import DecoderStats


def decode_one_token(form: str, model, tokens: torch.Tensor, cache: KVCache, span: int, keys: torch.Tensor,
                     counters: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """One plain step at a fixed shape: forward `tokens` [B], sample the next one per row with
    draw `counters` of its stream; (tokens [B], their log-probs [B], final hidden states [B, D]
    at `tokens`). No host sync. `form`: `model.form` (see `specialise`)."""
    specialise(form)
    logits_at = torch.zeros(tokens.shape[0], 1, dtype=torch.long, device=tokens.device)
    out = model(tokens[:, None], cache=cache, logits_at=logits_at, span=span)
    logprobs = sampling_logprobs(out.logits[:, -1], params)
    uniforms = None if params.greedy else row_uniforms(keys, counters, 1)[:, 0]
    return *sample_tokens(logprobs, uniforms, params), out.hidden[:, -1]


def compiled_min_rows(compiled_on_cuda: bool) -> int:
    """Fewest rows a decoder's sync-free steps run with. A compiled step specialises on a one-row
    batch (a graph of its own, minutes to compile on a GPU, where an extra row costs nothing): there
    a lone live row runs beside a finished one. On a CPU a graph compiles in seconds and a row costs."""
    return 2 if compiled_on_cuda else 1


class PlainDecoder(NoHorizonHeads):
    """One token per row per step: the vanilla baseline and the N_t = 1 fallback. The step is
    fixed-shape and sync-free, so it can run compiled (see `compiled_step`)."""

    max_tokens_per_step = 1

    def __init__(self, model, compile: bool = False) -> None:
        prepare_for_decoding(model)
        self.model = model
        self.decode = StepFunction(decode_one_token, compile, next(model.parameters()).device)
        self.min_rows = compiled_min_rows(self.compiled_on_cuda)

    @property
    def compiled(self) -> bool:
        return self.decode.compiled

    @property
    def compiled_on_cuda(self) -> bool:
        """Whether the step replays CUDA graphs."""
        return self.decode.compiled and self.decode.cuda_graphs

    def next_step_sync_free(self, state: DecodeState) -> bool:
        """Every step reads nothing on the host and lets finished rows stay."""
        return True

    def step(self, state: DecodeState) -> StepResult:
        tokens, logprobs, state.last_hidden = self.decode(self.model.form, self.model, state.last_tokens, state.cache,
                                                          state.span(1), state.rng.keys, state.rng.counters, state.params)
        state.rng.advance(1)
        state.cache.commit(state.live.long())  # a finished row rewrites the same slot from now on
        state.cached_bound += 1
        return StepResult(tokens[:, None], logprobs[:, None], torch.ones_like(tokens))

    def count_kept(self, emitted: torch.Tensor, kept: torch.Tensor) -> None:
        """One token a step: a response keeps all it emits, and no statistics count passes here."""

    def pop_stats(self) -> DecoderStats:
        return DecoderStats(self.decode.pop())

    # What the rollout actor asks of a decoder beyond its steps (`specroll.decoders.RolloutDecoder`): nothing learnt or kept.
    def learn_from_responses(self, prompts: list[list[int]], responses: list[list[int]], group_size: int) -> None:
        """Nothing: it drafts nothing to learn."""

    def pop_drafter_update(self) -> None:
        return None

    def checkpoint_state(self) -> DecoderCheckpoint:
        return DecoderCheckpoint()

    def load_checkpoint_state(self, state: DecoderCheckpoint) -> None:
        """Nothing to resume."""
