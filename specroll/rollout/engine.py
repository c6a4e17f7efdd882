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
from .sampling import RowRandom, SamplingParams, sample_tokens, sampling_logprobs
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


class DecodeState:
    """Per-row state of a generate call; rows are kept in cache order."""

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
        self.drafter_state = None  # per-row state a drafter keeps for the generate call (Reflex), with keep(rows)

    def keep(self, rows: torch.Tensor) -> None:
        self.cache.keep_rows(rows)
        self.history.keep(rows)
        self.prompt_lengths = self.prompt_lengths[rows]
        self.row_ids = self.row_ids[rows]
        self.last_tokens = self.last_tokens[rows]
        self.last_hidden = self.last_hidden[rows]
        self.rng.keep(rows)
        if self.drafter_state is not None:
            self.drafter_state.keep(rows)


class PlainDecoder:
    """One token per row per step: the vanilla baseline and the N_t = 1 fallback."""

    def __init__(self, model) -> None:
        self.model = model

    def step(self, state: DecodeState) -> StepResult:
        batch = state.last_tokens.shape[0]
        out = self.model(state.last_tokens[:, None], cache=state.cache)
        state.cache.commit(torch.ones(batch, dtype=torch.long, device=state.last_tokens.device))
        tokens, logprobs = sample_next(out.logits[:, -1], state.rng, state.params)
        return StepResult(tokens[:, None], logprobs[:, None], torch.ones_like(tokens))


def sample_next(logits: torch.Tensor, rng: RowRandom, params: SamplingParams):
    """Sample one token per row from [B, V] logits with each row's own random stream."""
    logprobs = sampling_logprobs(logits, params)
    uniforms = None if params.greedy else rng.draw(1)[:, 0]
    return sample_tokens(logprobs, uniforms, params.greedy)


class RolloutEngine:
    def __init__(self, model, tokenizer=None, spec=None, show_progress: bool = False) -> None:
        # Prepacked weights make the few-row products of decoding and tree verification
        # cheap on CPU; elsewhere they change nothing.
        self.model = model.eval().use_prepacked_linears()
        self.tokenizer = tokenizer
        self.show_progress = show_progress
        self.decoder = PlainDecoder(model) if spec is None else spec.build_decoder(model)
        self.device = next(model.parameters()).device

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
        n, num_prompts = params.n, len(prompts)
        num_rows = num_prompts * n
        context = self.model.config.max_position_embeddings
        prompt_lens = torch.tensor([len(p) for p in prompts])
        # A response never runs past the context window: its cap shrinks instead.
        row_caps = (context - prompt_lens).clamp(max=params.max_new_tokens).repeat_interleave(n)
        slack = getattr(self.decoder, "max_tokens_per_step", 1)
        max_len = int(prompt_lens.max()) + params.max_new_tokens + slack
        cache = KVCache.for_model(self.model, num_rows, max_len, live_rows=num_prompts)

        history = TokenHistory.from_prompts(prompts, max_len, self.device)
        first_logits, first_hidden = self.prefill(history, cache)
        cache.repeat_rows(n)
        history.repeat_rows(n)
        rng = RowRandom(params.seed, [(key, j) for key in keys for j in range(n)], self.device)
        first, first_lp = sample_next(first_logits.repeat_interleave(n, dim=0), rng, params)
        state = DecodeState(cache, history, torch.arange(num_rows, device=self.device), rng, first,
                            first_hidden.repeat_interleave(n, dim=0), params)

        tokens: list[list[int]] = [[] for _ in range(num_rows)]
        logprobs: list[list[float]] = [[] for _ in range(num_rows)]
        finish: list[str] = ["length"] * num_rows
        stops = self.stop_ids(params)
        active_per_step: list[int] = []
        bar = tqdm(total=int(row_caps.sum()), desc="rollout", unit="tok", disable=not self.show_progress)

        step = StepResult(first[:, None], first_lp[:, None], torch.ones_like(first))
        while True:
            done = self.append(step, state, tokens, logprobs, finish, row_caps, stops, bar)
            if bool(done.all()):
                break
            if bool(done.any()):
                state.keep(torch.nonzero(~done).squeeze(1))
            active_per_step.append(len(state.row_ids))
            step = self.decoder.step(state)
        bar.close()

        elapsed = time.perf_counter() - started
        num_tokens = sum(len(t) for t in tokens)
        stats = {
            "steps": len(active_per_step),
            "active_rows_per_step": active_per_step,
            "tokens": num_tokens,
            "wall_time_s": elapsed,
            "tokens_per_s": num_tokens / max(elapsed, 1e-9),
        }
        stats.update(getattr(self.decoder, "pop_stats", dict)())
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

    @staticmethod
    def append(step: StepResult, state: DecodeState, tokens, logprobs, finish, row_caps, stops, bar) -> torch.Tensor:
        """Record emitted tokens, cut them at a stop token or the length cap; return finished rows."""
        emitted = step.tokens.tolist()
        emitted_lp = step.logprobs.tolist()
        counts = step.counts.tolist()
        done = torch.zeros(len(counts), dtype=torch.bool)
        for r, row in enumerate(state.row_ids.tolist()):
            cap = int(row_caps[row])
            for tok, lp in zip(emitted[r][: counts[r]], emitted_lp[r][: counts[r]]):
                tokens[row].append(tok)
                logprobs[row].append(lp)
                bar.update(1)
                if tok in stops:
                    finish[row] = "stop"
                    done[r] = True
                    break
                if len(tokens[row]) >= cap:
                    done[r] = True
                    break
        state.history.append(step.tokens, step.counts)
        state.last_tokens = step.tokens.gather(1, (step.counts - 1).clamp(min=0)[:, None]).squeeze(1)
        return done.to(state.last_tokens.device)
