"""Batched rollout engine: prefill once per prompt, decode all responses, drop finished rows.

The loop is the same for plain and speculative decoding: a `step` feeds each active row's
last sampled token (plus, when speculating, a draft tree) and returns the tokens it emits;
the engine appends them, applies stop rules and removes finished rows from the batch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..models import KVCache, load_causal_lm
from .compiled_step import StepFunction, specialise
from .responses import ResponseBuffer
from .sampling import RowRandom, SamplingParams, row_uniforms, sample_tokens, sampling_logprobs
from .token_history import TokenHistory


@dataclass
class RolloutOutput:
    token_ids: list[list[int]]  # len(prompts) * n responses, prompt-major
    logprobs: list[list[float]]  # log-prob of each token under the distribution it was sampled from
    finish_reasons: list[str]  # "stop" (EOS / stop id) or "length"
    stats: dict = field(default_factory=dict)


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

    Sync-free steps (plain ones, and tree steps sized on the host) leave finished rows in the
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


def keep_emissions(responses: ResponseBuffer, history: TokenHistory, row_ids: torch.Tensor, live: torch.Tensor,
                   tokens: torch.Tensor, logprobs: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append a step's emissions (`tokens`, `logprobs` [B, K], the first `counts` [B] real) of the
    `live` rows to their responses and histories; (each row's last token, rows still live)."""
    kept = counts * live
    finished = responses.append(row_ids, live, tokens, logprobs, kept)
    history.append(tokens, kept)
    return tokens.gather(1, (counts - 1).clamp(min=0)[:, None]).squeeze(1), live & ~finished


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
    return *sample_tokens(logprobs, uniforms, params.greedy), out.hidden[:, -1]


def compiled_min_rows(compiled_on_cuda: bool) -> int:
    """Fewest rows a decoder's sync-free steps run with. A compiled step specialises on a one-row
    batch (a graph of its own, minutes to compile on a GPU, where an extra row costs nothing): there
    a lone live row runs beside a finished one. On a CPU a graph compiles in seconds and a row costs."""
    return 2 if compiled_on_cuda else 1


class PlainDecoder:
    """One token per row per step: the vanilla baseline and the N_t = 1 fallback. The step is
    fixed-shape and sync-free, so it can run compiled (see `compiled_step`)."""

    max_tokens_per_step = 1

    def __init__(self, model, compile: bool = False) -> None:
        self.model = model
        self.decode = StepFunction(decode_one_token, compile, next(model.parameters()).device)
        self.min_rows = compiled_min_rows(self.compiled_on_cuda)

    @property
    def compiled_on_cuda(self) -> bool:
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

    def pop_stats(self) -> dict:
        return self.decode.pop()


def without_idle_steps(decoder_stats: dict, rows_per_step: list[int]) -> dict:
    """A decoder's stats without the steps that ran after every row had finished (sync-free steps
    before the next read emit nothing), so its per-step list lines up with `active_rows_per_step`."""
    if "budget_per_step" not in decoder_stats:
        return decoder_stats
    budgets = [b for b, rows in zip(decoder_stats["budget_per_step"], rows_per_step) if rows]
    return decoder_stats | {"budget_per_step": budgets, "verify_steps": len(budgets)}


def sample_next(logits: torch.Tensor, rng: RowRandom, params: SamplingParams):
    """Sample one token per row from [B, V] logits with each row's own random stream."""
    logprobs = sampling_logprobs(logits, params)
    uniforms = None if params.greedy else rng.draw(1)[:, 0]
    return sample_tokens(logprobs, uniforms, params.greedy)


def batch_bucket(live: int, current: int) -> int:
    """Rows a fixed-shape step keeps for `live` unfinished rows of a `current`-row batch: the
    smallest power of two that holds them, once it is below the current size."""
    return min(1 << (live - 1).bit_length(), current)


class RolloutEngine:
    """Batched generation with a plain or speculative decoder.

    `compile`: run the plain decode step compiled (torch.compile; CUDA graphs on GPUs).
    `sync_every`: decode steps between two host reads of which rows are finished (to stop and
    to compact the batch); in between, steps run without any host synchronisation. A decoder
    says before each step whether it will read nothing on the host (`next_step_sync_free`:
    plain steps, and tree steps sized on the host); a step that reads is read before, with the
    finished rows dropped.
    """

    def __init__(self, model, tokenizer=None, spec=None, show_progress: bool = False, compile: bool = False,
                 sync_every: int = 8) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        # Prepacked weights make the few-row products of decoding and tree verification
        # cheap on CPU; elsewhere they change nothing.
        self.model = model.eval().use_prepacked_linears()
        self.tokenizer = tokenizer
        self.show_progress = show_progress
        self.sync_every = sync_every
        self.decoder = PlainDecoder(model, compile) if spec is None else spec.build_decoder(model, compile)
        self.device = next(model.parameters()).device
        # Compiled, the bookkeeping is a handful of fused kernels, not ~50 launches (no CUDA graph:
        # it appends to buffers made per call).
        self.keep_emissions = StepFunction(keep_emissions, compile, self.device, cuda_graphs=False)
        if compile:
            self.compile_bookkeeping()
        self.cache: KVCache | None = None  # reused across calls: allocation is costly, CUDA graphs want fixed addresses

    @torch.inference_mode()
    def compile_bookkeeping(self) -> None:
        """Compile `keep_emissions` for what decoding meets, now rather than in the first call: steps
        of one token and of several (trees), at one row (where a step runs one) and more. Sizes
        equal to no other, or torch.compile would take them for one."""
        widths = (1, 3) if getattr(self.decoder, "max_tokens_per_step", 1) > 1 else (1,)
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
            if getattr(self.decoder, "compiled_on_cuda", False):
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
        slack = getattr(self.decoder, "max_tokens_per_step", 1)
        max_len = int(prompt_lens.max()) + params.max_new_tokens + slack
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

        # Every row is done after its cap's worth of steps: the loop never runs longer.
        max_steps = int(row_caps.max()) - 1
        active = torch.zeros(max_steps + 1, dtype=torch.long, device=self.device)  # live rows per step
        bar = tqdm(total=int(row_caps[:num_rows].sum()), desc="rollout", unit="tok", disable=not self.show_progress)
        steps, unread = 0, 0  # unread: sync-free steps that may still run before the next host read
        self.record(StepResult(first[:, None], first_lp[:, None], torch.ones_like(first)), state, responses)
        while True:
            sync_free = self.next_step_sync_free(state)
            if unread == 0 or not sync_free or steps == max_steps:
                live = state.read_live()  # the only host read of the loop
                if self.show_progress:
                    bar.update(int(responses.lengths.sum()) - bar.n)
                if not live.any():
                    break
                sync_free = self.next_step_sync_free(state)
                self.compact(state, live, to_bucket=sync_free)
                unread = self.sync_every if sync_free else 1
            active[steps] = state.live.sum()
            self.record(self.decoder.step(state), state, responses)
            steps, unread = steps + 1, unread - 1
        bar.close()

        tokens, logprobs, finish = (outputs[:num_rows] for outputs in responses.to_lists())
        ran = active[:steps].tolist()
        active_per_step = [a for a in ran if a]
        elapsed = time.perf_counter() - started
        num_tokens = sum(len(t) for t in tokens)
        stats = {
            "steps": len(active_per_step),
            "active_rows_per_step": active_per_step,
            "tokens": num_tokens,
            "wall_time_s": elapsed,
            "prefill_s": prefill_s,
            "tokens_per_s": num_tokens / max(elapsed, 1e-9),
        }
        stats.update(without_idle_steps(getattr(self.decoder, "pop_stats", dict)(), ran))
        if self.keep_emissions.compiled:  # graphs compiled in this call, the bookkeeping's among them
            bookkeeping = self.keep_emissions.pop()
            stats |= {key: stats.get(key, 0) + value for key, value in bookkeeping.items()}
        return RolloutOutput(tokens, logprobs, finish, stats)

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
        return getattr(self.decoder, "min_rows", 1)

    def next_step_sync_free(self, state: DecodeState) -> bool:
        """Whether the decoder's next step reads nothing on the host (decoders without the method: never)."""
        ask = getattr(self.decoder, "next_step_sync_free", None)
        return ask is not None and ask(state)

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
        """Keep a step's emitted tokens (cut at a stop token or the length cap) and retire the
        rows it finished; all on the device."""
        state.last_tokens, state.live = self.keep_emissions(responses, state.history, state.row_ids, state.live,
                                                            step.tokens, step.logprobs, step.counts, begins_step=False)
