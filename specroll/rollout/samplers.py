"""The two token samplers and `sample_tokens`, the one function plain decoding, every tree node,
evaluation and the benchmarks draw with (`SamplingParams.sampler` picks the sampler).

Both turn one draw of a row's stream (`sampling.RowRandom`, a float64 uniform) into one token of a
distribution p, so a row's i-th token takes draw i in plain and speculative decoding alike:

- `inverse_cdf`: the first token whose cumulative mass exceeds the draw.
- `gumbel`, a two-stage draw whose noise a drafter can read (`draw_noise`; docs/design.md, "Drafts
  that read the coming draws"). S is the policy's GUMBEL_CANDIDATES most likely tokens at the node.
  With the draw's stage-0 uniform below p(S), the token is the argmax over S of log p_t + G_t, G_t
  the draw's Gumbel for token t; otherwise inverse CDF over the tokens outside S with the draw's
  stage-1 uniform. It is exact for any p: S is a function of p alone, and the stage uniforms and the
  Gumbels are independent functions of the draw's bits, so the first stage picks S with probability
  p(S), Gumbel-max then gives t in S with probability p_t / p(S), and inverse CDF gives t outside S
  with probability p_t / (1 - p(S)); P(t) = p_t either way. Draws are fresh per response position,
  so tokens are independent given their prefixes, as under inverse CDF. A seed gives other
  responses than under `inverse_cdf`.

Greedy decoding takes the argmax under either sampler.
"""
from __future__ import annotations

import torch

from .draw_noise import stage_uniform, token_gumbels
from .sampling import SamplingParams

# The Gumbel stage's candidates: a draw outside the policy's top 64 is a token no tree of 16 nodes
# drafts, and a larger K costs a CPU top-k that grows with it (docs/guide.md, "The sampler").
GUMBEL_CANDIDATES = 64


def sample_tokens(logprobs: torch.Tensor, uniforms: torch.Tensor | None,
                  params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token from each distribution in `logprobs` [..., V] (float32) with its draw in
    `uniforms` [...] by `params.sampler`, or the argmax when `params.greedy`; (tokens, their log-probs)."""
    if params.greedy:
        tokens = logprobs.argmax(dim=-1)
    else:
        flat, draws = logprobs.reshape(-1, logprobs.shape[-1]), uniforms.reshape(-1).double()
        if params.sampler == "gumbel":
            tokens = two_stage_gumbel(flat, draws)
        else:
            tokens = inverse_cdf(flat.exp(), draws)
        tokens = tokens.view(logprobs.shape[:-1])
    return tokens, torch.gather(logprobs, -1, tokens[..., None]).squeeze(-1)


def host_reads_are_free(x: torch.Tensor) -> bool:
    """Whether work may be skipped by reading `x` on the host: on a CPU outside a compiled step."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def two_stage_gumbel(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[N] one token per row of `logprobs` [N, V] (float32, normalised) with its draw `uniforms` [N]
    (float64): the `gumbel` sampler of the module docstring. On a CPU outside a compiled step only the
    rows drawn outside the candidates are scanned (a host read, free there); elsewhere every row is:
    fixed shapes, no host read, the same tokens."""
    top = most_likely_tokens(logprobs, min(GUMBEL_CANDIDATES, logprobs.shape[-1]))  # [N, K]
    top_lp = logprobs.gather(1, top).double()
    tokens = top.gather(1, (top_lp + token_gumbels(uniforms, top)).argmax(dim=-1, keepdim=True)).squeeze(1)
    if top.shape[1] == logprobs.shape[1]:  # the candidates are the whole vocabulary
        return tokens
    drawn_outside = stage_uniform(uniforms, 0) >= top_lp.exp().sum(dim=-1)  # the candidates hold p(S)
    if host_reads_are_free(logprobs):
        rows = drawn_outside.nonzero().squeeze(1)
        if len(rows):
            tokens[rows] = outside_draw(logprobs[rows], top[rows], uniforms[rows], tokens[rows])
        return tokens
    return torch.where(drawn_outside, outside_draw(logprobs, top, uniforms, tokens), tokens)


def outside_draw(logprobs: torch.Tensor, top: torch.Tensor, uniforms: torch.Tensor,
                 inside: torch.Tensor) -> torch.Tensor:
    """[N] inverse CDF over the tokens of `logprobs` [N, V] outside the candidates `top` [N, K] with the
    draws' stage-1 uniforms; a row with no mass there keeps its `inside` token (p(S) rounded below 1)."""
    rest = logprobs.exp().scatter(1, top, 0.0)
    return torch.where(rest.amax(dim=-1) > 0, inverse_cdf(rest, stage_uniform(uniforms, 1)), inside)


def most_likely_tokens(logprobs: torch.Tensor, k: int) -> torch.Tensor:
    """[N, k] the ids of each row's k largest values of `logprobs` [N, V] (float32), in no order; ties
    go to the lower token id, so the set depends on the row's values alone, whatever the batch or kernel.
    On a CPU outside a compiled step a float top-k serves every row without a tie at its k-th value."""
    if not host_reads_are_free(logprobs) or k == logprobs.shape[-1]:
        return tie_broken_top(logprobs, k)
    values, ids = logprobs.topk(k + 1, dim=-1)  # sorted, largest first
    top = ids[:, :k].contiguous()
    tied = (values[:, k - 1] == values[:, k]) & values[:, k].isfinite()  # tied at -inf: no mass either way
    if tied.any():
        top[tied] = tie_broken_top(logprobs[tied], k)
    return top


def tie_broken_top(logprobs: torch.Tensor, k: int) -> torch.Tensor:
    """`most_likely_tokens` for every row: a float64 key that scales each value by 1 + id x 2^-50,
    below float32's resolution and above float64's, so equal (negative) values order by id and others keep theirs."""
    scale = 1 + torch.arange(logprobs.shape[-1], device=logprobs.device, dtype=torch.float64) * 2.0 ** -50
    return (logprobs.double() * scale).topk(k, dim=-1, sorted=False).indices


# Inverse-CDF sampling scans the vocabulary in blocks: float32 block masses of 256 tokens (as
# accurate as the float32 probabilities) accumulated in float64 find the block holding the target
# mass, and only that block is scanned token by token in float64. Verification samples at every
# tree node, where a float64 cumulative sum over the vocabulary is slow and a float32 one drifts.
CDF_BLOCK = 256


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` [N, V] (unnormalised, >= 0, some mass), the first index whose
    cumulative mass exceeds `uniforms` [N] (float64, in [0, 1)) x the row's total mass."""
    rows, vocab = probs.shape
    size = min(CDF_BLOCK, vocab)  # a small vocabulary is one block, not one padded to 256
    pad = -vocab % size
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(rows, -1, size)
    block_mass = blocks.sum(dim=-1)  # [N, blocks]
    block_cdf = block_mass.double().cumsum(dim=-1)
    target = uniforms * block_cdf[:, -1]
    block = first_above(block_cdf, target, block_mass)
    within = torch.gather(blocks, 1, block[:, None, None].expand(-1, 1, size)).squeeze(1)
    before = torch.gather(block_cdf, 1, (block - 1).clamp(min=0)[:, None]).squeeze(1) * (block > 0)
    return block * size + first_above(before[:, None] + within.double().cumsum(dim=-1), target, within)


def first_above(cdf: torch.Tensor, target: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """First index of each row of `cdf` [N, K] (the cumulative sum of `mass`) above `target`
    [N]. Where rounding leaves none (the target within an ulp of the total), the last index
    with mass: a token of zero probability is never returned."""
    index = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    positions = torch.arange(1, cdf.shape[1] + 1, device=cdf.device)
    last_with_mass = ((mass > 0) * positions).argmax(dim=-1)
    return torch.where(index < cdf.shape[1], index, last_with_mass)
