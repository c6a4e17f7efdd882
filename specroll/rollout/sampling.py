"""What SpecRoll samples from and with: vanilla decoding and tree verification both use it.

Logits are turned into the log-probabilities of the distribution actually sampled from
(temperature, then top-k, then top-p, in float32), and a token is drawn (`samplers.sample_tokens`)
with a uniform from a counter-based per-row stream, so a row's samples depend only on the seed and
the row's identity, never on which other rows share the batch. A row's i-th generated token takes
draw i of its stream, in plain and speculative decoding alike (speculation/verification/verify.py),
so both give the same response for the same seed.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


SAMPLERS = ("inverse_cdf", "gumbel")  # see rollout/samplers.py


@dataclass
class SamplingParams:
    """How to sample responses; mirrors the usual vLLM / HF knobs."""

    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    max_new_tokens: int = 256  # response length cap
    n: int = 1  # responses per prompt (the GRPO group size)
    seed: int = 0  # same seed, same samples
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # extra stop ids besides EOS
    # How a draw becomes a token (rollout/samplers.py): inverse_cdf, or gumbel, whose noise drafts can read
    sampler: str = "inverse_cdf"

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities [..., V] (float32) of the distribution that `params` samples from.

    Tokens outside the top-k / top-p set get -inf. For greedy decoding the distribution is
    a point mass; we return the plain softmax (temperature 1) so reported log-probs stay
    informative, and `sample_tokens` takes the argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.log_softmax(logits, dim=-1)
    if params.temperature != 1.0:
        logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(logits < nucleus_floor(logits, params.top_p), float("-inf"))
    return torch.log_softmax(logits, dim=-1)


# Sorting a whole vocabulary is slow on a CPU, and a verify pass samples at every tree node: the
# nucleus is looked for among the most likely tokens first (a top-k, cheap), and only rows whose
# nucleus may reach past them are sorted whole (docs/guide.md, "Top-p on a CPU").
NUCLEUS_CANDIDATES = 128
# Probabilities in units of 2^-40 (below 2^-41 a token adds nothing): integer sums do not depend
# on their order, so the candidates and the whole sorted row give the same cut.
MASS_SCALE = 2.0 ** 40


def nucleus_floor(logits: torch.Tensor, top_p: float, candidates: int | None = None) -> torch.Tensor:
    """[..., 1] the least logit of each row's top-p nucleus: the tokens whose more likely tokens
    hold less than `top_p` of the mass (so tied tokens are kept or dropped together).

    On a CPU outside a compiled step, the `candidates` (default NUCLEUS_CANDIDATES) most likely
    tokens are searched first and rows are sorted whole only where those may not hold the
    nucleus (a host read, free on a CPU); elsewhere, or with `candidates` >= the vocabulary,
    every row is sorted: a fixed shape, no host read."""
    log_norm = logits.logsumexp(dim=-1, keepdim=True)
    target = round(top_p * MASS_SCALE)

    def cut(values: torch.Tensor, log_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The floor among `values` (sorted descending) and how many of them the nucleus keeps."""
        mass = torch.round(torch.exp((values - log_norm).float()) * MASS_SCALE).long()  # fp16 would overflow
        above = mass.cumsum(dim=-1) - mass
        kept = (above < target).sum(dim=-1, keepdim=True).clamp(min=1)
        return values.gather(-1, kept - 1), kept

    candidates = NUCLEUS_CANDIDATES if candidates is None else candidates
    if candidates >= logits.shape[-1] or logits.device.type != "cpu" or torch.compiler.is_compiling():
        return cut(logits.sort(dim=-1, descending=True).values, log_norm)[0]
    floor, kept = cut(logits.topk(candidates, dim=-1).values, log_norm)
    spills = kept[..., 0] == candidates  # the nucleus may hold tokens past the candidates
    if spills.any():
        floor[spills] = cut(logits[spills].sort(dim=-1, descending=True).values, log_norm[spills])[0]
    return floor


def _as_int64(value: int) -> int:
    """A 64-bit unsigned constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = (_as_int64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch shifts arithmetically)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The SplitMix64 finaliser on int64 tensors (wrapping arithmetic): a counter-based RNG."""
    z = x + _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def uniforms_at(keys: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """[rows, K] U[0, 1) in float64: draw number `draws` [rows, K] of each row's stream."""
    bits = splitmix64(splitmix64(keys[:, None] ^ splitmix64(draws)))
    return _shift_right(bits, 11).double() * (1.0 / (1 << 53))


def row_uniforms(keys: torch.Tensor, counters: torch.Tensor, num_draws: int) -> torch.Tensor:
    """[rows, num_draws] U[0, 1) in float64: draws counters .. counters + num_draws - 1 of each
    row's stream; pure, so a compiled step can take them and the caller advance the counters."""
    return uniforms_at(keys, counters[:, None] + torch.arange(num_draws, device=keys.device))


class RowRandom:
    """Counter-based uniforms per row: draw i of a row depends only on (seed, row key, i).

    A row's samples therefore never depend on which other rows share the batch, and
    drawing for thousands of rows is one vectorised op on any device.
    """

    def __init__(self, seed: int, row_keys: list[tuple[int, ...]], device) -> None:
        keys = [int.from_bytes(hashlib.blake2b(repr((seed, k)).encode(), digest_size=8).digest(), "little")
                for k in row_keys]
        self.keys = torch.tensor([_as_int64(k) for k in keys], dtype=torch.long, device=device)
        self.counters = torch.zeros(len(row_keys), dtype=torch.long, device=device)

    def draw(self, num_draws: int) -> torch.Tensor:
        """[rows, num_draws] independent U[0, 1) in float64; advances each row's counter."""
        uniforms = row_uniforms(self.keys, self.counters, num_draws)
        self.advance(num_draws)
        return uniforms

    def peek(self, ahead: torch.Tensor) -> torch.Tensor:
        """[rows, K] the draws `ahead` [rows, K] places past each row's counter, without advancing:
        a verify pass gives each tree node the draw of the token it would emit (see speculation/verification/verify.py)."""
        return uniforms_at(self.keys, self.counters[:, None] + ahead)

    def advance(self, num_draws: int | torch.Tensor) -> None:
        """Skip `num_draws` draws of every row, or [rows] draws row by row (the tokens a verify
        pass emitted, or those a compiled step took with `row_uniforms`)."""
        self.counters += num_draws

    def keep(self, rows: torch.Tensor) -> None:
        self.keys, self.counters = self.keys[rows], self.counters[rows]
