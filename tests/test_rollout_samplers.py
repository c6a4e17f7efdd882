"""The token samplers alone: each draws from the float64 reference distribution (chi-square over many
draws of one distribution), the two-stage Gumbel draw through both its stages; its candidates and
their ties by hand; the compiled draw is the eager one; and a Gumbel draw without its mass stage fails."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from exactness import near_cutoff, reference_probs
from scipy.stats import chisquare

from specroll.config_checks import FieldError
from specroll.configs.sections import RolloutConfig
from specroll.rollout import RowRandom, SamplingParams, sample_tokens, sampling_logprobs
from specroll.rollout.draw_noise import token_gumbels
from specroll.rollout.samplers import GUMBEL_CANDIDATES, most_likely_tokens, two_stage_gumbel

VOCAB, DRAWS = 2048, 40000
PASS_P, FAIL_P = 1e-4, 1e-6


def logits_of(scale: float, seed: int) -> torch.Tensor:
    """[VOCAB] Gaussian logits: a large scale puts nearly all mass in the top candidates, a small one little."""
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def draws(params: SamplingParams, logits: torch.Tensor, sampler=sample_tokens) -> np.ndarray:
    """DRAWS tokens of one distribution, each with its own draw of one row's stream."""
    uniforms = RowRandom(params.seed, [(0,)], "cpu").draw(DRAWS)[0]
    logprobs = sampling_logprobs(logits, params).expand(DRAWS, -1)
    return sampler(logprobs, uniforms, params)[0].numpy()


def chi_square_p(tokens: np.ndarray, probs: np.ndarray) -> float:
    """p-value of `tokens` under `probs`; tokens expected fewer than 5 times pooled; a token of
    probability 0 gives 0."""
    observed = np.bincount(tokens, minlength=len(probs)).astype(float)
    if observed[probs == 0].sum():
        return 0.0
    expected = probs * len(tokens)
    rare = expected < 5
    if expected[rare].sum() > 0:
        observed, expected = np.append(observed[~rare], observed[rare].sum()), np.append(expected[~rare], expected[rare].sum())
    else:
        observed, expected = observed[~rare], expected[~rare]
    return float(chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


SETTINGS = {  # sampling settings, the logits' scale
    "t1": (dict(temperature=1.0), 3.0),
    "t07": (dict(temperature=0.7), 3.0),
    "topp09": (dict(temperature=1.0, top_p=0.9), 3.0),
    "topk20": (dict(temperature=1.0, top_k=20), 1.0),
    "flat": (dict(temperature=1.0), 0.5),  # the top candidates hold little of the mass
}


@pytest.mark.parametrize("sampler", ["gumbel", "inverse_cdf"])
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_draws_follow_the_reference_distribution(name, sampler, record_property):
    sampling, scale = SETTINGS[name]
    pvalues, seeds = [], (s for s in range(100) if not near_cutoff(logits_of(scale, s).numpy(), 1.0, 0, 0.9))
    for seed in [next(seeds) for _ in range(3)]:  # top-p keeps every token by a margin
        params = SamplingParams(seed=seed, sampler=sampler, **sampling)
        logits = logits_of(scale, seed)
        probs = reference_probs(logits.numpy(), params.temperature, params.top_k, params.top_p)
        tokens = draws(params, logits)
        pvalues.append(chi_square_p(tokens, probs))
        outside = np.argsort(-probs)[GUMBEL_CANDIDATES:]
        if name == "flat":  # both stages drew many tokens
            assert 0.2 * DRAWS < np.isin(tokens, outside).sum() < 0.95 * DRAWS
    record_property("pvalues", pvalues)
    print(f"{sampler} {name}: min p {min(pvalues):.3g}")
    assert min(pvalues) * len(pvalues) > PASS_P, pvalues


def gumbel_inside_only(logprobs: torch.Tensor, uniforms: torch.Tensor, params: SamplingParams):
    """WRONG on purpose: Gumbel-max over the top candidates, never drawing outside them (no mass stage)."""
    top = most_likely_tokens(logprobs, GUMBEL_CANDIDATES)
    best = (logprobs.gather(1, top).double() + token_gumbels(uniforms, top)).argmax(dim=-1, keepdim=True)
    return top.gather(1, best).squeeze(1), None


@pytest.mark.parametrize("name", ["flat", "t1"])
def test_a_gumbel_draw_without_its_mass_stage_is_rejected(name, record_property):
    sampling, scale = SETTINGS[name]
    params = SamplingParams(seed=0, sampler="gumbel", **sampling)
    logits = logits_of(scale, 0)
    p = chi_square_p(draws(params, logits, gumbel_inside_only), reference_probs(logits.numpy(), 1.0))
    record_property("pvalue", p)
    print(f"gumbel without the mass stage, {name}: p {p:.3g}")
    assert p < FAIL_P


def test_candidates_are_the_most_likely_tokens_ties_to_the_lower_id():
    logprobs = torch.log_softmax(torch.tensor([[0.0, 2.0, 1.0, 1.0, 3.0, 1.0], [1.0] * 6]), dim=-1)
    # Row 0: 3.0 and 2.0, then one of the three tokens tied at 1.0, the lowest id (2).
    assert sorted(most_likely_tokens(logprobs, 3)[0].tolist()) == [1, 2, 4]
    assert sorted(most_likely_tokens(logprobs, 3)[1].tolist()) == [0, 1, 2]
    assert sorted(most_likely_tokens(logprobs, 4)[0].tolist()) == [1, 2, 3, 4]


@pytest.mark.compile
def test_the_compiled_draw_is_the_eager_one_ties_and_outside_draws_included():
    """Compiled (as in the compiled decode step) every row takes the fixed-shape path, with no host
    read (fullgraph would fail on one); the tokens are the eager path's, which reads on the host."""
    g = torch.Generator().manual_seed(5)
    scales = torch.tensor([0.3, 1.0, 3.0, 8.0]).repeat_interleave(16)[:, None]
    logits = (torch.randn(len(scales), VOCAB, generator=g) * scales).round(decimals=1)  # ties at the K-th value
    logprobs = sampling_logprobs(logits, SamplingParams())
    uniforms = RowRandom(0, [(r,) for r in range(len(scales))], "cpu").draw(1)[:, 0]
    eager = two_stage_gumbel(logprobs, uniforms)
    compiled = torch.compile(two_stage_gumbel, fullgraph=True, dynamic=True)(logprobs, uniforms)
    assert torch.equal(compiled, eager)
    ranks = (logprobs > logprobs.gather(1, eager[:, None])).sum(dim=1)
    assert (ranks >= GUMBEL_CANDIDATES).sum() > 5  # some rows drew outside the candidates


def test_the_sampler_is_a_validated_rollout_setting():
    assert RolloutConfig(sampler="gumbel").sampling_params(seed=3).sampler == "gumbel"
    assert SamplingParams().sampler == "inverse_cdf"
    with pytest.raises(FieldError, match="sampler"):
        RolloutConfig(sampler="gumbel_max")
    with pytest.raises(ValueError, match="sampler"):
        SamplingParams(sampler="icdf")
