"""Batched rollout engine: prefill once per prompt, decode all responses, drop finished rows.

The loop is the same for plain and speculative decoding: a `step` feeds each active row's
last sampled token (plus, when speculating, a draft tree) and returns the tokens it emits;
the engine appends them, applies stop rules and removes finished rows from the batch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..models import KVCache, load_causal_lm
from .compiled_step import StepFunction
from .decode_state import DecodeState, StepResult, cache_shape
from .decoder import Decoder
from .plain_decoder import PlainDecoder
from .responses import ResponseBuffer
from .samplers import sample_tokens
from .sampling import RowRandom, SamplingParams, sampling_logprobs
from .stats import GenerationStats, without_idle_steps
from .token_history import TokenHistory


@dataclass
class RolloutOutput:
    token_ids: list[list[int]]  # len(prompts) * n responses, prompt-major
    logprobs: list[list[float]]  # log-prob of each token under the distribution it was sampled from
    finish_reasons: list[str]  # "stop" (EOS / stop id) or "length"
    stats: GenerationStats


def keep_emissions(responses: ResponseBuffer, history: TokenHistory, row_ids: torch.Tensor, live: torch.Tensor,
                   tokens: torch.Tensor, logprobs: torch.Tensor,
                   counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Append a step's emissions (`tokens`, `logprobs` [B, K], the first `counts` [B] real) of the
    `live` rows to their responses and histories; (each row's last token, rows still live, tokens
    each row's response kept: cut at a stop token or the length cap)."""
    emitted = counts * live
    finished, kept = responses.append(row_ids, live, tokens, logprobs, emitted)
    history.append(tokens, emitted)
    return tokens.gather(1, (counts - 1).clamp(min=0)[:, None]).squeeze(1), live & ~finished, kept


def sample_next(logits: torch.Tensor, rng: RowRandom, params: SamplingParams):
    """Sample one token per row from [B, V] logits with each row's own random stream."""
    logprobs = sampling_logprobs(logits, params)
    uniforms = None if params.greedy else rng.draw(1)[:, 0]
    return sample_tokens(logprobs, uniforms, params)


def batch_bucket(live: int, current: int) -> int:
    """Rows a fixed-shape step keeps for `live` unfinished rows of a `current`-row batch: the
    smallest power of two that holds them, once it is below the current size."""
    return min(1 << (live - 1).bit_length(), current)


class RolloutEngine:
    """Batched generation with a plain or speculative decoder.

    `decoder`: what runs each step (`decoder.Decoder`; `specroll.decoders.build_decoder` builds the
    one a rollout config asks for); None: a `PlainDecoder`, compiled when `compile` is set
    (torch.compile; CUDA graphs on GPUs). The engine's own bookkeeping compiles with the decoder.
    `sync_every`: decode steps between two host reads of which rows are finished (to stop and
    to compact the batch); in between, steps run without any host synchronisation. A decoder
    says before each step whether it will read nothing on the host (`next_step_sync_free`:
    plain steps, and sync-free tree steps); a step that reads is read before, with the
    finished rows dropped.
    """

    def __init__(self, model, tokenizer=None, decoder: Decoder | None = None, show_progress: bool = False,
                 compile: bool = False, sync_every: int = 8) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        if decoder is not None and compile:
            raise ValueError("compile=True compiles the engine's plain decoder: build a decoder passed in compiled")
        self.model = model  # made ready for decoding by the decoder (`prepare_for_decoding`)
        self.tokenizer = tokenizer
        self.show_progress = show_progress
        self.sync_every = sync_every
        self.decoder: Decoder = PlainDecoder(model, compile) if decoder is None else decoder
        self.device = next(model.parameters()).device
        # Compiled, the bookkeeping is a handful of fused kernels, not ~50 launches (no CUDA graph:
        # it appends to buffers made per call).
        self.keep_emissions = StepFunction(keep_emissions, self.decoder.compiled, self.device, cuda_graphs=False)
        if self.decoder.compiled:
            self.compile_bookkeeping()
        self.cache: KVCache | None = None  # reused across calls: allocation is costly, CUDA graphs want fixed addresses

    @torch.inference_mode()
    def compile_bookkeeping(self) -> None:
        """Compile `keep_emissions` for what decoding meets, now rather than in the first call: steps
        of one token and of several (trees), at one row (where a step runs one) and more. Sizes
        equal to no other, or torch.compile would take them for one."""
        widths = (1, 3) if self.decoder.max_tokens_per_step > 1 else (1,)
        for batch, width in ((batch, width) for batch in range(self.min_rows, 3) for width in widths):
            responses = ResponseBuffer(torch.full((4,), 6), set(self.model.config.eos_token_ids), 6, self.device)
            history = TokenHistory.from_prompts([[0] * 3] * batch, 11, self.device)
            tokens = torch.zeros(batch, width, dtype=torch.long, device=self.device)
            self.keep_emissions(responses, history, torch.arange(batch, device=self.device),
                                torch.ones(batch, dtype=torch.bool, device=self.device), tokens,
                                torch.zeros(batch, width, device=self.device),
                                torch.ones(batch, dtype=torch.long, device=self.device), begins_step=False)
        self.keep_emissions.pop()  # compiled up front: no generate call's compiles

    @classmethod
    def from_pretrained(cls, name_or_path: str, dtype: str = "float32", device: str = "auto", **kwargs):
        model, tokenizer = load_causal_lm(name_or_path, dtype=dtype, device=device)
        return cls(model, tokenizer, **kwargs)

    def stop_ids(self, params: SamplingParams) -> set[int]:
        return set(self.model.config.eos_token_ids) | set(params.stop_token_ids)

    def check_prompts(self, prompts: list[list[int]]) -> None:
        if not prompts:
            raise ValueError("prompts is empty: pass at least one list of token ids")
        context = self.model.config.max_position_embeddings
        vocab = self.model.config.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if len(p) >= context:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; the model's context is {context} tokens"
                )
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab})")

    def cache_for(self, rows: int, max_len: int, live_rows: int) -> KVCache:
        """An empty KV cache of at least `rows` x `max_len`, the previous call's when it fits."""
        p = next(self.model.parameters())
        cache = self.cache
        if cache is None or cache.rows < rows or cache.max_len < max_len or cache.k[0].dtype != p.dtype \
                or cache.k[0].device != p.device:
            self.cache = cache = None  # free the old one before allocating
            cache = KVCache.for_model(self.model, *cache_shape(rows, max_len))
            if self.decoder.compiled_on_cuda:
                cache.mark_static()
            self.cache = cache
        cache.lengths.zero_()
        cache.batch_size = live_rows
        return cache

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None,
                 prompt_keys: list | None = None) -> RolloutOutput:
        """`params.n` responses per prompt. `prompt_keys` names each prompt's random streams
        (default: its index); a shard of a larger batch passes global keys, so a response's
        samples do not depend on how the batch was split."""
        params = params or SamplingParams()
        self.check_prompts(prompts)
        keys = list(range(len(prompts))) if prompt_keys is None else list(prompt_keys)
        if len(keys) != len(prompts):
            raise ValueError(f"prompt_keys has {len(keys)} entries for {len(prompts)} prompts")
        started = time.perf_counter()
        num_rows = len(prompts) * params.n  # responses asked for
        padding = max(self.min_rows - num_rows, 0)
        if padding:  # finished companion rows, dropped from the output (see compiled_min_rows)
            prompts, keys = prompts + prompts[:1] * padding, keys + [("padding", i) for i in range(padding)]
        n, num_prompts = params.n, len(prompts)
        context = self.model.config.max_position_embeddings
        prompt_lens = torch.tensor([len(p) for p in prompts])
        # A response never runs past the context window: its cap shrinks instead.
        row_caps = (context - prompt_lens).clamp(max=params.max_new_tokens).repeat_interleave(n)
        max_len = int(prompt_lens.max()) + params.max_new_tokens + self.decoder.max_tokens_per_step
        cache = self.cache_for(num_prompts * n, max_len, num_prompts)

        history = TokenHistory.from_prompts(prompts, max_len, self.device)
        first_logits, first_hidden = self.prefill(history, cache)
        cache.repeat_rows(n)
        history.repeat_rows(n)
        rng = RowRandom(params.seed, [(key, j) for key in keys for j in range(n)], self.device)
        first, first_lp = sample_next(first_logits.repeat_interleave(n, dim=0), rng, params)
        state = DecodeState(cache, history, torch.arange(num_prompts * n, device=self.device), rng, first,
                            first_hidden.repeat_interleave(n, dim=0), params)
        state.live[num_rows:] = False
        responses = ResponseBuffer(row_caps, self.stop_ids(params), params.max_new_tokens, self.device)
        prefill_s = time.perf_counter() - started

        first_step = StepResult(first[:, None], first_lp[:, None], torch.ones_like(first))
        active = self.decode(state, responses, first_step, row_caps, num_rows)
        tokens, logprobs, finish = (outputs[:num_rows] for outputs in responses.to_lists())
        ran = active.tolist()
        elapsed = time.perf_counter() - started
        return RolloutOutput(tokens, logprobs, finish, self.generation_stats(ran, tokens, elapsed, prefill_s))

    def decode(self, state: DecodeState, responses: ResponseBuffer, first: StepResult, row_caps: torch.Tensor,
               num_rows: int) -> torch.Tensor:
        """Keep each row's `first` token, then step until every row is finished (cut at its cap in
        `row_caps` [rows], or at a stop token); the live rows of each step [steps], on the device.
        The first `num_rows` rows are the responses asked for (the progress bar's)."""
        # Every row is done after its cap's worth of steps: the loop never runs longer.
        max_steps = int(row_caps.max()) - 1
        active = torch.zeros(max_steps + 1, dtype=torch.long, device=self.device)  # live rows per step
        bar = tqdm(total=int(row_caps[:num_rows].sum()), desc="rollout", unit="tok", disable=not self.show_progress)
        steps, unread = 0, 0  # unread: sync-free steps that may still run before the next host read
        self.record(first, state, responses)
        while True:
            sync_free = self.decoder.next_step_sync_free(state)
            if unread == 0 or not sync_free or steps == max_steps:
                live = state.read_live()  # the only host read of the loop
                if self.show_progress:
                    bar.update(int(responses.lengths.sum()) - bar.n)
                if not live.any():
                    break
                sync_free = self.decoder.next_step_sync_free(state)
                self.compact(state, live, to_bucket=sync_free)
                unread = self.sync_every if sync_free else 1
            active[steps] = state.live.sum()
            self.record(self.decoder.step(state), state, responses)
            steps, unread = steps + 1, unread - 1
        bar.close()
        return active[:steps]

    def generation_stats(self, ran: list[int], tokens: list[list[int]], elapsed: float,
                         prefill_s: float) -> GenerationStats:
        """The call's stats: `ran` live rows per step run (0: a sync-free step after every row had
        finished), `tokens` the responses, `elapsed` and `prefill_s` its seconds."""
        active_per_step = [a for a in ran if a]
        num_tokens = sum(len(t) for t in tokens)
        decoded = self.decoder.pop_stats()
        # Graphs compiled in this call, the bookkeeping's among them.
        compiled = decoded.compiled + self.keep_emissions.pop()
        return GenerationStats(steps=len(active_per_step), active_rows_per_step=active_per_step, tokens=num_tokens,
                               wall_time_s=elapsed, prefill_s=prefill_s, tokens_per_s=num_tokens / max(elapsed, 1e-9),
                               compile_s=compiled.compile_s, compiles=compiled.compiles,
                               tree=without_idle_steps(decoded.tree, ran))

    def prefill(self, prompts: TokenHistory, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Run every prompt once (right-padded); logits [P, V] and hidden state [P, D] at its last token."""
        lengths = prompts.lengths
        ids = prompts.tokens[:, : int(lengths.max())]
        # Right padding is harmless under causal attention: real tokens never see the pads.
        out = self.model(ids, cache=cache, logits_at=(lengths - 1)[:, None])
        cache.commit(lengths)
        last = (lengths - 1)[:, None, None].expand(-1, 1, out.hidden.shape[-1])
        return out.logits[:, 0], torch.gather(out.hidden, 1, last)[:, 0]

    @property
    def min_rows(self) -> int:
        """Fewest rows the decoder's sync-free steps run with (`compiled_min_rows`)."""
        return self.decoder.min_rows

    def compact(self, state: DecodeState, live: torch.Tensor, to_bucket: bool) -> None:
        """Drop finished rows: all of them, or down to the next power-of-two bucket that holds the
        live rows (finished rows fill it up) before sync-free steps, keeping `min_rows` rows."""
        num_live, batch = int(live.sum()), len(live)
        size = max(batch_bucket(num_live, batch), min(self.min_rows, batch)) if to_bucket else num_live
        if size == batch:
            return
        rows = torch.cat((torch.nonzero(live).squeeze(1), torch.nonzero(~live).squeeze(1)))[:size]
        state.keep(rows.to(self.device))

    def record(self, step: StepResult, state: DecodeState, responses: ResponseBuffer) -> None:
        """Keep a step's emitted tokens (cut at a stop token or the length cap), retire the rows it
        finished and tell the decoder what each row kept (its statistics count that); all on the device."""
        emitted = step.counts * state.live
        state.last_tokens, state.live, kept = self.keep_emissions(responses, state.history, state.row_ids, state.live,
                                                                  step.tokens, step.logprobs, step.counts,
                                                                  begins_step=False)
        self.decoder.count_kept(emitted, kept)
