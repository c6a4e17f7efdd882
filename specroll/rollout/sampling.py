"""The one sampling function of SpecRoll: vanilla decoding and tree verification both use it.

Logits are turned into the log-probabilities of the distribution actually sampled from
(temperature, then top-k, then top-p, in float32), and a token is drawn by inverse-CDF
sampling with a uniform from a per-row generator. Per-row generators make a row's samples depend only on the
seed and the row's identity, never on which other rows share the batch.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


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
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass.
        drop_sorted = (probs.cumsum(-1) - probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def row_generator(seed: int, row_key: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Generator:
    """A generator whose stream depends only on (seed, row_key), e.g. (prompt index, sample index)."""
    digest = hashlib.blake2b(repr((seed, row_key)).encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def uniform_draws(generators: list[torch.Generator], num_draws: int, device) -> torch.Tensor:
    """Independent U[0, 1) draws [rows, num_draws] (float64), one generator per row."""
    return torch.stack(
        [torch.rand(num_draws, generator=g, device=device, dtype=torch.float64) for g in generators]
    )


def sample_tokens(logprobs: torch.Tensor, uniforms: torch.Tensor | None, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token from each distribution in `logprobs` [..., V]; returns (tokens, their log-probs).

    Inverse-CDF sampling with one uniform per distribution (`uniforms` [...]): exact, and it
    needs one random number per tree node instead of V. Greedy takes the argmax.
    """
    if greedy:
        tokens = logprobs.argmax(dim=-1)
    else:
        cdf = torch.cumsum(logprobs.exp().double(), dim=-1)
        target = (uniforms * cdf[..., -1]).unsqueeze(-1)
        # First index whose cumulative mass exceeds the target: it always has non-zero mass.
        tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=logprobs.shape[-1] - 1)
    return tokens, torch.gather(logprobs, -1, tokens[..., None]).squeeze(-1)
