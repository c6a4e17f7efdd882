"""The exactness tests' reference sampler and statistics (tests/exactness.py), on hand-worked cases."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chi2, chisquare

from exactness import (
    GUMBEL_TIE,
    Decisions,
    acceptance_test,
    gumbel_hit_chance,
    multinomial_sum_test,
    near_cutoff,
    reference_probs,
)
from specroll.rollout import SamplingParams, sampling_logprobs
from specroll.rollout.draw_noise import token_gumbels


def test_top_k_keeps_every_token_tied_with_the_kth():
    probs = reference_probs(np.array([2.0, 1.0, 1.0, 0.0]), temperature=1.0, top_k=2)
    e = math.e
    np.testing.assert_allclose(probs, [e**2 / (e**2 + 2 * e), e / (e**2 + 2 * e), e / (e**2 + 2 * e), 0.0])


def test_top_p_keeps_or_drops_tied_tokens_together():
    logits = np.log([0.5, 0.2, 0.2, 0.1])
    # Strictly more likely mass: 0, 0.5, 0.5, 0.9. Below 0.6: the first three.
    np.testing.assert_allclose(reference_probs(logits, 1.0, top_p=0.6), [0.5 / 0.9, 0.2 / 0.9, 0.2 / 0.9, 0.0])
    np.testing.assert_allclose(reference_probs(logits, 1.0, top_p=0.5), [1.0, 0.0, 0.0, 0.0])


def test_temperature_then_top_k_then_top_p():
    # T = 0.5 doubles the logits: [2, 0, -2, -4] -> top-2 keeps [2, 0] -> probs e^2/(e^2+1), 1/(e^2+1) = 0.881, 0.119;
    # top-p 0.85: the second token has 0.881 above it, so it goes.
    probs = reference_probs(np.array([1.0, 0.0, -1.0, -2.0]), temperature=0.5, top_k=2, top_p=0.85)
    np.testing.assert_allclose(probs, [1.0, 0.0, 0.0, 0.0])
    probs = reference_probs(np.array([1.0, 0.0, -1.0, -2.0]), temperature=0.5, top_k=2, top_p=0.9)
    np.testing.assert_allclose(probs, [math.e**2 / (math.e**2 + 1), 1 / (math.e**2 + 1), 0.0, 0.0])


@pytest.mark.parametrize("params", [dict(temperature=0.7), dict(temperature=1.0, top_k=5), dict(temperature=1.3, top_p=0.8),
                                    dict(temperature=0.6, top_k=20, top_p=0.9)])
def test_reference_agrees_with_the_sampler_away_from_cut_offs(params):
    logits = torch.randn(200, 32, generator=torch.Generator().manual_seed(0)) * 3
    ours = sampling_logprobs(logits, SamplingParams(**params)).exp().double().numpy()
    ref = reference_probs(logits.double().numpy(), params["temperature"], params.get("top_k", 0), params.get("top_p", 1.0))
    away = ~near_cutoff(logits.double().numpy(), params["temperature"], params.get("top_k", 0), params.get("top_p", 1.0))
    assert away.mean() > 0.95
    np.testing.assert_allclose(ours[away], ref[away], atol=1e-6)


def test_near_cutoff_marks_rows_whose_kept_set_hangs_on_rounding():
    logits = np.log(np.array([[0.5, 0.4, 0.1], [0.6, 0.25, 0.15]]))
    assert near_cutoff(logits, 1.0, top_p=0.9).tolist() == [True, False]  # 0.5 + 0.4 is the cut-off itself
    assert near_cutoff(np.array([[1.0, 0.5, 0.5 + 1e-6]]), 1.0, top_k=2).tolist() == [True]


def one_hot(tokens, vocab):
    out = np.zeros((len(tokens), vocab), dtype=bool)
    out[np.arange(len(tokens)), tokens] = True
    return out


def test_multinomial_sum_test_is_pearson_for_identical_rows():
    tokens = [0] * 210 + [1] * 110 + [2] * 80
    probs = np.tile([0.5, 0.3, 0.2], (400, 1))
    # Expected 200 / 120 / 80: chi-square 100/200 + 100/120 + 0 = 4/3 on 2 degrees of freedom.
    assert multinomial_sum_test(one_hot(tokens, 3), probs) == pytest.approx(math.exp(-2 / 3))
    assert multinomial_sum_test(one_hot(tokens, 3), probs) == pytest.approx(chisquare([210, 110, 80], [200, 120, 80]).pvalue)


def test_multinomial_sum_test_of_varying_rows():
    # Two halves with different distributions: counts 150 / 250 of token 0 vs expected 0.25*200 + 0.75*200 = 200.
    probs = np.concatenate([np.tile([0.25, 0.75], (200, 1)), np.tile([0.75, 0.25], (200, 1))])
    tokens = [0] * 50 + [1] * 150 + [0] * 100 + [1] * 100
    variance = 200 * 0.25 * 0.75 * 2  # sum of p(1 - p)
    assert multinomial_sum_test(one_hot(tokens, 2), probs) == pytest.approx(chi2.sf(50**2 / variance, 1))
    assert multinomial_sum_test(one_hot([0] * 399 + [1], 2), np.tile([1.0, 0.0], (400, 1))) == 0.0  # impossible token


def test_acceptance_test_compares_hits_with_the_drafted_mass():
    # 100 decisions where the drafted child (token 0) has probability 0.5; it was emitted 60 times.
    tokens = np.array([0] * 60 + [1] * 40)
    drafted = np.zeros((100, 2), dtype=bool)
    drafted[:, 0] = True
    dec = Decisions(probs=np.tile([0.5, 0.5], (100, 1)), tokens=tokens, depth=np.ones(100, dtype=int), drafted=drafted,
                    logprobs=np.zeros(100), response=np.arange(100), position=np.zeros(100, dtype=int))
    assert acceptance_test(dec, [(0, 0), (1, 1)]) == pytest.approx(chi2.sf((60 - 50) ** 2 / 25, 1))


def test_gumbel_hit_chance_of_a_clear_winner_and_of_a_tie():
    """Tokens 0 and 1 in the Gumbel stage (mass 0.9), token 2 outside it (0.1); token 0 is drafted.
    Row 0: token 0's perturbed value leads by 1: a hit whenever the Gumbel stage draws (0.9). Row 1:
    it leads by a tenth of GUMBEL_TIE, which float32 log-probs cannot resolve: half of that."""
    draw = np.array([0.25, 0.25])
    g = token_gumbels(torch.as_tensor(draw), torch.arange(3).expand(2, -1)).numpy()[0]
    probs = []
    for lead in (1.0, GUMBEL_TIE / 10):
        # log p0 + g0 = log p1 + g1 + lead, with p0 + p1 = 0.9.
        ratio = math.exp(g[1] - g[0] + lead)
        p1 = 0.9 / (1 + ratio)
        probs.append([0.9 - p1, p1, 0.1])
    drafted = np.zeros((2, 3), dtype=bool)
    drafted[:, 0] = True
    dec = Decisions(probs=np.array(probs), tokens=np.zeros(2, dtype=int), depth=np.ones(2, dtype=int), drafted=drafted,
                    logprobs=np.zeros(2), response=np.arange(2), position=np.zeros(2, dtype=int))
    assert gumbel_hit_chance(dec, draw, candidates=2) == pytest.approx([0.9, 0.45])
