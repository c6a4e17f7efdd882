"""The one sampling function: hand-worked distributions, seeding, and what the engine samples."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from exactness import near_cutoff, reference_probs
from scipy.stats import chisquare

from specroll.models import build_tiny_model
from specroll.rollout import RolloutEngine, SamplingParams, sampling_logprobs
from specroll.rollout.samplers import CDF_BLOCK, first_above, inverse_cdf
from specroll.rollout.sampling import nucleus_floor

NEG_INF = float("-inf")
LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0])
PROMPT_A = [5, 9, 13]
PROMPT_B = [7, 8, 20, 21, 22, 23, 24, 25]
PROMPT_C = [30, 31, 32, 33, 34]


@pytest.fixture(scope="module")
def engine():
    # Wide enough an initialisation that the next-token distributions are far from uniform.
    return RolloutEngine(build_tiny_model("llama", seed=0, init_std=0.2))


def assert_logprobs(params: SamplingParams, expected: list[float]) -> None:
    got = sampling_logprobs(LOGITS, params)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor(expected), rtol=0, atol=1e-6)


# log(e^2 + e^1) = 2 + log(1 + e^-1): the normaliser once only the two best tokens remain.
TOP_TWO = [-math.log(1 + math.exp(-1)), -1 - math.log(1 + math.exp(-1)), NEG_INF, NEG_INF]


def test_logprobs_plain_softmax():
    norm = math.log(math.exp(2) + math.exp(1) + 1 + math.exp(-1))
    assert_logprobs(SamplingParams(), [2 - norm, 1 - norm, -norm, -1 - norm])


def test_logprobs_temperature():
    # Logits / 2 = [1, 0.5, 0, -0.5].
    norm = math.log(math.exp(1) + math.exp(0.5) + 1 + math.exp(-0.5))
    assert_logprobs(SamplingParams(temperature=2.0), [1 - norm, 0.5 - norm, -norm, -0.5 - norm])


def test_logprobs_top_k():
    assert_logprobs(SamplingParams(top_k=2), TOP_TWO)


def test_logprobs_top_p():
    # Softmax is [0.644, 0.237, 0.087, 0.032].
    # top_p 0.5: the best token alone already holds 0.644 >= 0.5.
    assert_logprobs(SamplingParams(top_p=0.5), [0.0, NEG_INF, NEG_INF, NEG_INF])
    # top_p 0.8: 0.644 < 0.8 keeps the second token; 0.881 >= 0.8 drops the third.
    assert_logprobs(SamplingParams(top_p=0.8), TOP_TWO)


def test_top_p_keeps_tied_tokens_together_whether_or_not_the_candidates_hold_the_nucleus():
    # Softmax of [1, 0, 1, -1] is [0.400, 0.147, 0.400, 0.054]: no token ranks above a tied best one.
    tied = torch.tensor([1.0, 0.0, 1.0, -1.0])
    for candidates in (2, 4):  # two candidates, then the whole row
        # top_p 0.3: both best tokens have nothing above them; 0.80 is above the third.
        assert nucleus_floor(tied, 0.3, candidates).item() == 1.0
        # top_p 0.9: the two candidates hold 0.80 < 0.9, so the row is sorted whole: 0.80 above
        # the third keeps it, 0.947 above the fourth drops it.
        assert nucleus_floor(tied, 0.9, candidates).item() == 0.0
    norm = math.log(2 * math.e + 1)
    torch.testing.assert_close(sampling_logprobs(tied, SamplingParams(top_p=0.9)),
                               torch.tensor([1 - norm, -norm, 1 - norm, NEG_INF]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_the_nucleus_among_candidates_is_the_one_of_the_whole_sorted_row_and_of_the_rule(top_p):
    """Rows from flat (the nucleus holds most of the 500 tokens) to peaked (a few): searched
    among 16 candidates, sorted whole only where those may not hold the nucleus, the cut is the
    one of sorting every row, and the kept tokens are the float64 rule's."""
    generator = torch.Generator().manual_seed(0)
    scales = torch.tensor([0.05, 0.5, 1.0, 2.0, 4.0, 8.0]).repeat_interleave(20)[:, None]
    logits = torch.randn(len(scales), 500, generator=generator) * scales
    floor = nucleus_floor(logits, top_p, candidates=16)
    torch.testing.assert_close(floor, nucleus_floor(logits, top_p, candidates=500), rtol=0, atol=0)
    kept = logits >= floor
    sizes = kept.sum(-1)
    assert (sizes < 16).any() and (sizes > 16).any(), "both the candidates and whole sorts are exercised"
    expected = reference_probs(logits.numpy(), 1.0, top_p=top_p) > 0
    clear = ~near_cutoff(logits.numpy(), 1.0, top_p=top_p, tolerance=1e-6)
    assert clear.sum() > 0.9 * len(logits)
    np.testing.assert_array_equal(kept.numpy()[clear], expected[clear])


def test_a_compiled_nucleus_search_sorts_every_row_and_finds_the_same_cut():
    """Compiled (as in the compiled decode step) every row is sorted whole, a fixed shape with no
    host read (fullgraph would fail on one), and the cut is the one the eager search among
    candidates finds."""
    logits = torch.randn(12, 300, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.05, 6, 12)[:, None]
    compiled = torch.compile(nucleus_floor, fullgraph=True, dynamic=True)  # as the compiled decode step
    torch.testing.assert_close(compiled(logits, 0.9, 16), nucleus_floor(logits, 0.9, 16), rtol=0, atol=0)


def test_logprobs_temperature_before_top_p():
    # At temperature 0.5 the best token holds e^4 / (e^4 + e^2 + 1 + e^-2) = 0.865 >= 0.8.
    assert_logprobs(SamplingParams(temperature=0.5, top_p=0.8), [0.0, NEG_INF, NEG_INF, NEG_INF])


def test_logprobs_top_k_before_top_p():
    # After top-2 the best token holds 1 / (1 + e^-1) = 0.731 >= 0.7 (it held 0.644 before).
    assert_logprobs(SamplingParams(top_k=2, top_p=0.7), [0.0, NEG_INF, NEG_INF, NEG_INF])


def test_logprobs_greedy_reports_the_plain_softmax():
    assert_logprobs(SamplingParams(temperature=0.0, top_k=1), sampling_logprobs(LOGITS, SamplingParams()).tolist())


def test_logprobs_are_per_row():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    got = sampling_logprobs(logits, SamplingParams(top_k=2))
    torch.testing.assert_close(got[0], torch.tensor(TOP_TWO), rtol=0, atol=1e-6)
    torch.testing.assert_close(got[1], torch.tensor(TOP_TWO).flip(0), rtol=0, atol=1e-6)


def flat_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The definition: one float64 cumulative sum over the whole vocabulary."""
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(1)


@pytest.mark.parametrize("vocab", [CDF_BLOCK * 3, 1000, 7])
def test_blocked_inverse_cdf_is_the_flat_one(vocab):
    g = torch.Generator(torch.get_default_device()).manual_seed(vocab)
    probs = torch.softmax(3 * torch.randn(500, vocab, generator=g), dim=-1)
    probs[:200] *= torch.rand(200, vocab, generator=g) < 0.1  # masked rows, some blocks all zero
    probs[:200, 0] += 1e-3  # every row keeps some mass
    uniforms = torch.rand(500, generator=g, dtype=torch.float64)
    uniforms[:3] = torch.tensor([0.0, 0.5, 0.999999])
    assert torch.equal(inverse_cdf(probs, uniforms), flat_inverse_cdf(probs, uniforms))


def test_inverse_cdf_never_returns_a_token_without_mass():
    probs = torch.zeros(1, 2 * CDF_BLOCK)  # mass on two tokens of the first block only
    probs[0, 10], probs[0, 20] = 0.25, 0.75
    assert inverse_cdf(probs, torch.tensor([0.0], dtype=torch.float64)).item() == 10
    assert inverse_cdf(probs, torch.tensor([0.25], dtype=torch.float64)).item() == 20
    # u x total can round up to the total, which no cumulative sum exceeds: the last token
    # with mass is taken, not the end of the vocabulary.
    mass = torch.tensor([[0.25, 0.0, 0.75, 0.0]])
    cdf = mass.double().cumsum(-1)
    assert first_above(cdf, torch.tensor([1.0], dtype=torch.float64), mass).item() == 2
    assert first_above(cdf, torch.tensor([0.25], dtype=torch.float64), mass).item() == 2


@torch.no_grad()
def teacher_forced_logits(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Logits [len(response), V] each response token was sampled from, by a full forward."""
    seq = torch.tensor([prompt + response[:-1]])
    return model(seq).logits[0, len(prompt) - 1 :]


def rows_of(out, prompts, n):
    """(prompt, response) of every output row, prompt-major."""
    return [(prompts[i // n], out.token_ids[i]) for i in range(len(prompts) * n)]


def test_same_seed_same_samples(engine):
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, max_new_tokens=24, n=4, seed=11)
    first = engine.generate([PROMPT_A, PROMPT_B], params)
    second = engine.generate([PROMPT_A, PROMPT_B], params)
    assert first.token_ids == second.token_ids
    assert first.logprobs == second.logprobs


def test_different_seeds_differ(engine):
    params = SamplingParams(max_new_tokens=16, n=4, seed=0)
    a = engine.generate([PROMPT_A], params).token_ids
    b = engine.generate([PROMPT_A], SamplingParams(max_new_tokens=16, n=4, seed=1)).token_ids
    assert all(x != y for x, y in zip(a, b))
    assert len({tuple(t) for t in a}) == 4  # the n samples of one prompt differ too


def test_samples_do_not_depend_on_the_rest_of_the_batch(engine):
    # Several stop ids make rows finish (and leave the batch) at different steps.
    params = SamplingParams(max_new_tokens=30, n=3, seed=5, stop_token_ids=(2, 3, 4, 6))
    with_b = engine.generate([PROMPT_A, PROMPT_B], params)
    with_c = engine.generate([PROMPT_A, PROMPT_C], params)
    alone = engine.generate([PROMPT_A], params)
    for other in (with_b, with_c):
        assert len({len(t) for t in other.token_ids}) > 2, "rows should finish at different steps"
        assert other.token_ids[:3] == alone.token_ids
        for got, expected in zip(other.logprobs[:3], alone.logprobs):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=0, atol=1e-5)
    assert with_b.token_ids[3:] != with_c.token_ids[3:]


@pytest.mark.parametrize("top_k", [1, 3])
def test_top_k_never_samples_outside_the_k_most_likely(engine, top_k):
    prompts = [PROMPT_A, PROMPT_B]
    params = SamplingParams(top_k=top_k, max_new_tokens=20, n=4, seed=2)
    out = engine.generate(prompts, params)
    for prompt, response in rows_of(out, prompts, params.n):
        logits = teacher_forced_logits(engine.model, prompt, response)
        for step, token in enumerate(response):
            better = int((logits[step] > logits[step, token] + 1e-4).sum())
            assert better < top_k, f"step {step}: token {token} has {better} more likely tokens"


@pytest.mark.parametrize("temperature, top_p", [(1.0, 0.5), (0.7, 0.8)])
def test_top_p_never_samples_outside_the_nucleus(engine, temperature, top_p):
    prompts = [PROMPT_A, PROMPT_B]
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=20, n=4, seed=3)
    out = engine.generate(prompts, params)
    for prompt, response in rows_of(out, prompts, params.n):
        probs = torch.softmax(teacher_forced_logits(engine.model, prompt, response) / temperature, dim=-1)
        for step, token in enumerate(response):
            # The token is in the nucleus iff the tokens more likely than it hold < top_p.
            mass_above = float(probs[step][probs[step] > probs[step, token]].sum())
            assert mass_above < top_p + 1e-5, f"step {step}: {mass_above:.4f} of the mass ranks above {token}"


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=10, top_p=0.9, max_new_tokens=20, n=3, seed=4),
        SamplingParams(temperature=1.3, max_new_tokens=20, n=3, seed=4),
        SamplingParams(temperature=0.0, max_new_tokens=20, n=1),
    ],
    ids=["processed", "plain", "greedy"],
)
def test_returned_logprobs_match_teacher_forcing(engine, params):
    prompts = [PROMPT_A, PROMPT_C]
    out = engine.generate(prompts, params)
    for i, (prompt, response) in enumerate(rows_of(out, prompts, params.n)):
        logits = teacher_forced_logits(engine.model, prompt, response)
        expected = sampling_logprobs(logits, params).gather(1, torch.tensor(response)[:, None]).squeeze(1)
        assert len(out.logprobs[i]) == len(response)
        torch.testing.assert_close(torch.tensor(out.logprobs[i]), expected, rtol=0, atol=1e-4)
        if params.greedy:
            assert response == logits.argmax(-1).tolist()


def chi_square_p(samples: list[int], probs: torch.Tensor) -> float:
    """p-value of the samples under `probs`; tokens expected fewer than 5 times are pooled."""
    observed = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    expected = probs.double() * len(samples)
    rare = expected < 5
    observed = torch.cat([observed[~rare], observed[rare].sum()[None]])
    expected = torch.cat([expected[~rare], expected[rare].sum()[None]])
    if expected[-1] == 0:
        assert observed[-1] == 0, "sampled a token of probability 0"
        observed, expected = observed[:-1], expected[:-1]
    return float(chisquare(observed.cpu().numpy(), expected.cpu().numpy() * observed.sum().item() / expected.sum().item()).pvalue)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(max_new_tokens=1, n=4000, seed=0), SamplingParams(temperature=0.7, top_k=8, max_new_tokens=1, n=4000, seed=1)],
    ids=["softmax", "temperature-top-k"],
)
def test_one_token_samples_follow_the_distribution(engine, params):
    samples = [t[0] for t in engine.generate([PROMPT_A], params).token_ids]
    with torch.no_grad():
        logits = engine.model(torch.tensor([PROMPT_A])).logits[0, -1]
    assert chi_square_p(samples, sampling_logprobs(logits, params).exp()) > 1e-3
    # The test has the power to notice a wrong distribution: the untempered softmax is rejected.
    if params.temperature != 1.0:
        assert chi_square_p(samples, torch.softmax(logits, -1).masked_fill(sampling_logprobs(logits, params).isinf(), 0)) < 1e-3
