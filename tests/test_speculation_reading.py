"""Drafts that read the coming draws (speculation/drafting/reading.py): the children the noise
favours, the Gumbel chance of a chain's token, the calibration by rank and margin, and trees
drafted from them."""
from __future__ import annotations

import math

import pytest
import torch

from specroll.models import build_tiny_model
from specroll.rollout import SamplingParams
from specroll.rollout.draw_noise import token_gumbels
from specroll.rollout.sampling import uniforms_at
from specroll.speculation import HorizonHeads, draft_candidates, select_tree
from specroll.speculation.drafting import reading
from specroll.speculation.drafting.reading import (
    MARGIN_BINS,
    MARGIN_EDGES,
    node_draws,
    read_chain,
    read_children,
    reading_prior,
    reading_rates,
)


def test_node_draws_are_the_draws_verification_gives_each_depth():
    keys, counters = torch.tensor([11, -7]), torch.tensor([0, 5])
    draws = node_draws(keys, counters, 3)
    for row in range(2):
        for depth in range(3):
            assert draws[row, depth] == uniforms_at(keys[row : row + 1], counters[row, None, None] + depth)[0, 0]


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.5, 1.0), (1.0, 0.7)])
def test_children_are_the_best_of_log_q_plus_the_draws_noise_with_their_rank_and_margin(temperature, top_p):
    logp = torch.log_softmax(torch.tensor([[[2.0, 1.5, 1.0, 0.5, 0.0, -1.0]]]), dim=-1)  # [1, 1, 6]
    vocab = torch.tensor([40, 41, 42, 43, 44, 45])
    draws = torch.tensor([0.123456789], dtype=torch.float64)
    top_lp, tokens, cells = read_children(logp, vocab, draws, 3, SamplingParams(temperature=temperature, top_p=top_p))
    # By hand: every token's log q as the sampler would sample it (tempered, in its nucleus: q's
    # two likeliest hold 0.67 < 0.7, the three 0.83, so three are kept) + its own Gumbel under the draw, sorted.
    nucleus = 3 if top_p < 1 else 6
    tempered = torch.log_softmax(logp[0, 0, :nucleus] / temperature, -1).tolist() + [-math.inf] * (6 - nucleus)
    noise = token_gumbels(draws, vocab[None])[0].float()
    perturbed = sorted(((tempered[i] + float(noise[i]), i) for i in range(6)), reverse=True)
    best = [i for _, i in perturbed[:3]]
    assert tokens[0, 0].tolist() == [int(vocab[i]) for i in best]
    assert torch.allclose(top_lp[0, 0], logp[0, 0, best])
    gaps = [perturbed[0][0] - perturbed[1][0]] + [perturbed[0][0] - perturbed[r][0] for r in (1, 2)]
    assert all(torch.isfinite(top_lp[0, 0]))  # the head's own log-probs, whatever the sampler keeps
    expected = [r * MARGIN_BINS + sum(g > e for e in MARGIN_EDGES) for r, g in enumerate(gaps)]
    assert cells[0, 0].tolist() == expected


def test_children_come_from_the_heads_likeliest_tokens_as_the_gumbel_stage_draws_from_the_policys(monkeypatch):
    """The sampler's Gumbel stage draws among the policy's GUMBEL_CANDIDATES likeliest tokens, so a
    read child's best guess is among the heads' likeliest as many, whatever noise the others have."""
    monkeypatch.setattr(reading, "GUMBEL_CANDIDATES", 2)
    logp = torch.log_softmax(torch.tensor([[[0.1, 0.0, -0.1, -0.2, -0.3, -0.4]]]), dim=-1)  # nearly flat
    for u in torch.linspace(0.01, 0.99, 50, dtype=torch.float64):
        _, tokens, _ = read_children(logp, None, u[None], 2, SamplingParams())
        assert set(tokens[0, 0].tolist()) == {0, 1}


def test_a_chains_chance_is_the_gumbel_chance_of_a_token_of_its_probability():
    """Gumbel-max over a token of probability a and the rest: the token wins as often as
    exp(-(1/a - 1) e^-g) says, in every bin of its own noise g, and a of the time overall."""
    a, draws_n = 0.3, 40000
    draws = (torch.arange(draws_n, dtype=torch.float64) + 0.5) / draws_n  # distinct draws, distinct noise
    token, others = torch.tensor([5]), torch.tensor([0, 1, 2, 3, 4, 6, 7])
    p_others = torch.tensor([0.3, 0.15, 0.1, 0.05, 0.05, 0.03, 0.02])  # sums to 1 - a
    noise = token_gumbels(draws, torch.cat((token, others)).expand(draws_n, -1))
    wins = (math.log(a) + noise[:, 0] > (p_others.log().double() + noise[:, 1:]).max(dim=1).values)
    chance = read_chain(torch.full((draws_n, 1), math.log(a)), token.expand(draws_n, 1), draws[:, None]).exp()[:, 0]
    assert abs(wins.double().mean() - a) < 0.01 and abs(chance.double().mean() - a) < 0.01
    for low, high in [(0, 0.2), (0.2, 0.5), (0.5, 0.8), (0.8, 1.01)]:
        cell = (chance >= low) & (chance < high)
        assert cell.sum() > 2000
        assert abs(wins[cell].double().mean() - chance[cell].double().mean()) < 0.02, (low, high)


def test_reading_rates_learn_each_cells_hit_rate_where_its_parent_was_reached():
    rate = reading_prior(2, 2, "cpu")  # [2 depths, 2 ranks x MARGIN_BINS]
    # Row 0: nodes 1 (cell 0) and 2 (cell 5) below the root, node 3 (cell 0) below node 1 and
    # node 4 (cell 1) below node 2; the pass accepted node 1, then its bonus token (node 3 missed).
    # Row 1 is finished: nothing it holds counts.
    cells = torch.tensor([[0, 5, 0, 1], [0, 5, 0, 1]])
    depths = torch.tensor([[1, 1, 2, 2], [1, 1, 2, 2]])
    parents = torch.tensor([[0, 0, 1, 2], [0, 0, 1, 2]])
    valid = torch.ones(2, 4, dtype=torch.bool)
    path, counts = torch.tensor([[0, 1, 1], [0, 1, 3]]), torch.tensor([2, 3])
    new = reading_rates(rate, 0.9, cells, depths, parents, valid, path, counts, torch.tensor([True, False]))
    expected = rate.clone()
    expected[0, 0] = 0.9 * rate[0, 0] + 0.1 * 1.0  # node 1: tried and the draw
    expected[0, 5] = 0.9 * rate[0, 5] + 0.1 * 1e-3  # node 2: tried, missed (the floor)
    expected[1, 0] = 0.9 * rate[1, 0] + 0.1 * 1e-3  # node 3: its parent reached, missed
    assert torch.allclose(new, expected)  # node 4's parent was never reached: cell (2, 1) untouched


def test_a_chain_node_or_padding_teaches_the_reading_calibration_nothing():
    rate = reading_prior(1, 1, "cpu")
    new = reading_rates(rate, 0.5, torch.tensor([[-1, 0]]), torch.ones(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long),
                        torch.tensor([[True, False]]), torch.tensor([[0, 1]]), torch.tensor([2]), torch.tensor([True]))
    assert torch.equal(new, rate)


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(init_std=0.3, seed=1)


@pytest.mark.parametrize("head_type", ["path", "medusa"])
def test_reading_trees_draft_what_the_draws_favour_and_stay_connected(model, head_type):
    heads = HorizonHeads.for_model(model, head_type, num_heads=3)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    hidden, roots = torch.randn(2, model.config.hidden_size, generator=g), torch.tensor([5, 9])
    draws = node_draws(torch.tensor([3, 4]), torch.tensor([0, 7]), 3)
    log_reading = reading_prior(3, 8, "cpu").log()
    sampling = SamplingParams()
    cands = draft_candidates(heads, model, hidden, roots, 9, torch.zeros(3), draws=draws, log_reading=log_reading,
                             sampling=sampling)
    # The root's children: the best of log q + the depth-0 draw's noise.
    logq = torch.log_softmax(model.lm_head(heads.step(0, hidden[:, None], hidden[:, None], model.embed_tokens(roots)[:, None])
                                           if head_type == "path" else heads.step(0, None, hidden[:, None], None)), -1)[:, 0]
    noise = token_gumbels(draws[:, 0], torch.arange(logq.shape[-1]).expand(2, -1)).float()
    first = cands.depths == 1
    for row in range(2):
        assert set(cands.tokens[row][first[row]].tolist()) == set((logq[row] + noise[row]).topk(int(first[row].sum())).indices.tolist())
    # Each scored by the better of its read chance and its blind score (head log-prob + calibration, here 0).
    blind = cands.head_probs[first].log()
    assert torch.allclose(cands.scores[first], torch.maximum(log_reading[0][cands.cells[first]], blind))
    tree = select_tree(cands, 9)
    parent_scores = torch.cat((torch.zeros(2, 1), cands.scores.gather(1, tree.candidates)), 1).gather(1, tree.parents)
    assert (cands.scores.gather(1, tree.candidates) <= parent_scores).all()  # any best-k prefix is a tree
    # A pure function of the drafter's state and the draws: the same draws give the same tree, others another.
    again = draft_candidates(heads, model, hidden, roots, 9, torch.zeros(3), draws=draws, log_reading=log_reading,
                             sampling=sampling)
    assert torch.equal(again.tokens, cands.tokens) and torch.equal(again.scores, cands.scores)
    other = draft_candidates(heads, model, hidden, roots, 9, torch.zeros(3), draws=node_draws(torch.tensor([3, 4]),
                             torch.tensor([1, 8]), 3), log_reading=log_reading, sampling=sampling)
    assert not torch.equal(other.tokens, cands.tokens)
