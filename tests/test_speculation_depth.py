"""Tree depth as its own setting (`speculation.max_depth`): every structure sized by depth follows
the decoder's `depth`, also when heads of another depth are set on a live decoder."""
from __future__ import annotations

import pytest
import torch

from specroll.models import build_tiny_model
from specroll.rollout import RolloutEngine, SamplingParams
from specroll.speculation import HorizonHeads, SpeculationConfig, SpeculativeDecoder

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(init_std=0.3, seed=1)


def random_heads(model, num_heads: int, seed: int = 0) -> HorizonHeads:
    heads = HorizonHeads.for_model(model, "path", num_heads)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return heads


def trees_pay(decoder: SpeculativeDecoder) -> None:
    """A profile where a pass costs the same at every tree size: the cost model drafts full trees."""
    prof = decoder.profile
    prof.batch_sizes, prof.nodes = [1, 4096], [1, 2, 4, 8]
    prof.latency_s = [[1.0] * len(prof.nodes) for _ in prof.batch_sizes]


def decode_matches_plain(model, engine: RolloutEngine) -> SamplingParams:
    """Sampled speculative responses equal plain decoding's for the same seed (coupled draws)."""
    params = SamplingParams(max_new_tokens=24, n=2, seed=3)
    out = engine.generate(PROMPTS, params)
    assert out.token_ids == RolloutEngine(model).generate(PROMPTS, params).token_ids
    return out


def assert_sized_by(decoder: SpeculativeDecoder, depth: int) -> None:
    assert decoder.depth == depth
    assert decoder.estimates.observed.shape == decoder.estimates.predicted.shape == (depth,)
    assert decoder.estimates.lookup_acceptance.rate.shape[-1] == depth
    assert decoder.pass_counts.max_depth == depth


@pytest.mark.parametrize("spec", [
    dict(budget="cost_model"),  # its drafting times by depth
    dict(budget="fixed", fixed_nodes=8, adaptation="slow"),  # the slow path's head records
    dict(budget="fixed", fixed_nodes=8, sync_free_trees=True),  # sync-free tree steps
    dict(budget="fixed", fixed_nodes=8, sibling_lookup=True, history_lookup=True),  # sibling and history chains
], ids=["cost_model", "slow_path", "sync_free", "suffix"])
def test_heads_of_another_depth_on_a_live_decoder_resize_what_depth_sizes(model, spec, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path))  # the cost model measures and caches a profile
    decoder = SpeculativeDecoder(model, SpeculationConfig(heads_path=None, max_nodes=8, **spec),
                                 heads=random_heads(model, 4))
    if decoder.cost_model is not None:
        trees_pay(decoder)
    engine = RolloutEngine(model, decoder=decoder)
    decode_matches_plain(model, engine)
    for depth in (6, 2):  # deeper, then shallower than the heads the decoder started with
        decoder.set_heads(random_heads(model, depth, seed=depth))
        assert_sized_by(decoder, depth)
        out = decode_matches_plain(model, engine)
        assert len(out.stats.tree.acceptance_by_depth) == depth
        assert max(out.stats.tree.budget_per_step) > 1  # trees were drafted and verified
        if decoder.cost_model is not None:
            assert len(decoder.cost_model.draft_s) == depth + 1 and decoder.cost_model.draft_s[depth] > 0
        if decoder.suffix is not None:
            assert decoder.suffix.history_acceptance.rate.shape[-1] == depth
        if decoder.records is not None:
            telemetry, _ = decoder.pop_head_records()
            assert telemetry.records.shape[0] == depth  # one row per head, as the consolidation actor's


@pytest.mark.parametrize("sync_free", [False, True])
def test_max_depth_below_the_heads_caps_every_tree(model, sync_free):
    cfg = SpeculationConfig(heads_path=None, budget="fixed", fixed_nodes=8, max_nodes=8, max_depth=2,
                            sync_free_trees=sync_free)
    decoder = SpeculativeDecoder(model, cfg, heads=random_heads(model, 4))
    assert (decoder.sync_free is not None) == sync_free
    assert_sized_by(decoder, 2)
    out = decode_matches_plain(model, RolloutEngine(model, decoder=decoder))
    assert len(out.stats.tree.acceptance_by_depth) == 2
    assert max(out.stats.tree.tokens_per_step_hist) <= 3  # two drafts and the bonus token at most


def test_max_depth_deeper_than_the_heads_is_refused(model):
    with pytest.raises(ValueError, match=r"^max_depth must be null or <= the heads' depth \(4\), got 5: no draft source "
                                         r"reaches past the last head yet$"):
        SpeculationConfig(max_depth=5)
    with pytest.raises(ValueError, match="^max_depth must be an int >= 1, got 0$"):
        SpeculationConfig(max_depth=0)
    decoder = SpeculativeDecoder(model, SpeculationConfig(heads_path=None, budget="fixed", max_depth=3),
                                 heads=random_heads(model, 4))
    kept = decoder.heads
    with pytest.raises(ValueError, match=r"^max_depth must be null or <= the heads' depth \(2\), got 3"):
        decoder.set_heads(random_heads(model, 2))
    assert decoder.heads is kept and decoder.depth == 3 and decoder.estimates.observed.shape == (3,)
