"""The noise of a draw: a function of the draw and the token id alone, Gumbel-distributed, and
independent across tokens, draws and stages."""
import math

import torch
from scipy import stats

from specroll.rollout.draw_noise import draw_bits, stage_uniform, token_gumbels
from specroll.rollout.sampling import RowRandom


def draws(rows: int = 4, count: int = 2000) -> torch.Tensor:
    return RowRandom(seed=7, row_keys=[(r,) for r in range(rows)], device="cpu").draw(count)


def test_the_bits_of_a_draw_are_its_uniform_times_two_to_the_53():
    u = draws()
    assert torch.equal(draw_bits(u).double() / 2 ** 53, u)


def test_the_same_draw_and_token_give_the_same_noise_wherever_they_are_asked():
    u = draws(rows=2, count=3)
    tokens = torch.tensor([5, 9, 5, 1000])
    whole = token_gumbels(u, tokens.expand(2, 3, 4))
    one = token_gumbels(u[1, 2], torch.tensor([9, 5]))
    assert torch.equal(one, whole[1, 2, [1, 0]]) and torch.equal(whole[..., 0], whole[..., 2])
    assert whole[..., 0].unique().numel() == 6  # other draws, other noise


def test_token_noise_is_standard_gumbel_and_uncorrelated_across_tokens_draws_and_stages():
    u = draws().reshape(-1)  # 8000 draws
    g = token_gumbels(u, torch.tensor([0, 1, 49151]).expand(u.numel(), 3))
    for column in g.T:
        assert stats.kstest(column.numpy(), "gumbel_r").pvalue > 1e-3
    assert abs(g.mean().item() - 0.5772) < 0.05 and abs(g.var().item() - math.pi ** 2 / 6) < 0.1
    for a, b in ((g[:, 0], g[:, 1]), (g[:, 1], g[:, 2]), (g[:-1, 0], g[1:, 0]),
                 (stage_uniform(u, 0), stage_uniform(u, 1)), (stage_uniform(u, 0), u)):
        assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.05
    for stage in (0, 1):
        s = stage_uniform(u, stage)
        assert 0 < s.min() and s.max() < 1 and stats.kstest(s.numpy(), "uniform").pvalue > 1e-3
