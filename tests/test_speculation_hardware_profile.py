"""Hardware profile: C_hw from a latency table, interpolation, measurement and its cache."""
from __future__ import annotations

import pytest
import torch

from specroll.models import build_tiny_model
from specroll.models.prepacked_linear import PrepackedLinear
from specroll.rollout import RolloutEngine, SamplingParams
from specroll.speculation import SpeculationConfig, SpeculativeDecoder
from specroll.speculation.budgets.policies import cost_model_budget, resolve_budget, speculation_may_pay
from specroll.speculation.budgets.hardware_profile import HardwareProfile, get_profile, measure_profile


def table_profile(latency_ms: list[list[float]]) -> HardwareProfile:
    prof = HardwareProfile("m", "cpu", "float32", 256, [1, 4, 16], [1, 2, 4, 8],
                           [[t / 1e3 for t in row] for row in latency_ms])
    prof.capacity = prof.derive_capacity()
    return prof


def test_capacity_is_the_largest_total_within_slack_of_one_token():
    # base 100 ms, slack 1.25 -> cells <= 125 ms fit: (1, 8) = 8 nodes, (4, 2) = 8, (16, 1) = 16.
    prof = table_profile([[100, 104, 110, 124],
                          [110, 120, 140, 200],
                          [125, 160, 250, 400]])
    assert prof.capacity == 16
    prof = table_profile([[100, 130, 150, 200], [140, 160, 200, 300], [200, 300, 400, 600]])
    assert prof.capacity == 1  # nothing but one token fits: the concurrency budget is plain decoding


def test_latency_interpolates_between_grid_points():
    prof = table_profile([[100, 110, 120, 140], [120, 140, 160, 200], [200, 300, 400, 600]])
    assert prof.latency(1, 3) == pytest.approx(0.115)
    assert prof.latency(10, 1) == pytest.approx(0.160)  # halfway from batch 4 (120) to 16 (200)
    # Past batch 16: batch 32 x 2 nodes costs what batch 16 x 4 nodes does (same tokens) ...
    assert prof.latency(32, 2) == pytest.approx(0.400)
    # ... and past 8 nodes the last segment (400 -> 600 ms over 4 nodes) continues: 16 x 16 = 1000 ms.
    assert prof.latency(32, 8) == pytest.approx(1.000)


def test_cost_model_prefers_more_nodes_only_when_they_pay():
    prof = table_profile([[100, 110, 120, 140], [120, 140, 160, 200], [200, 300, 400, 600]])
    # Expected tokens for N = 1..8 of one row: each extra node adds less.
    gains = torch.tensor([[1.0, 1.3, 1.5, 1.6, 1.65, 1.7, 1.72, 1.74]])
    assert cost_model_budget(gains, prof, 1, 1, 8) == 4  # 1.6/0.12 beats 1.5/0.115 and 1.74/0.14
    flat = torch.ones(1, 8)
    assert cost_model_budget(flat, prof, 1, 1, 8) == 1  # drafts that never hit: plain decoding
    # The best tree (4 nodes: 13.3 tokens/s) beats plain (10/s) by 33%: kept under a 30% margin, not 35%.
    assert cost_model_budget(gains, prof, 1, 1, 8, min_gain=0.30) == 4
    assert cost_model_budget(gains, prof, 1, 1, 8, min_gain=0.35) == 1


def test_measure_profile_times_every_cell_and_the_cache_round_trips(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path))
    model = build_tiny_model(seed=0)
    model.config.name = "tiny-profiled"
    prof = measure_profile(model, cache_len=32, batch_sizes=[1, 2], nodes=[1, 3], repeats=2)
    assert len(prof.latency_s) == 2 and all(len(row) == 2 and min(row) > 0 for row in prof.latency_s)
    assert prof.capacity >= 1
    assert all(m.prepacked for m in model.modules() if isinstance(m, PrepackedLinear))  # as the engine runs it
    prof.save()
    loaded = get_profile(model, cache_len=32)  # cached: no new measurement
    assert loaded == prof


def test_drafting_time_counts_against_speculation():
    prof = table_profile([[100, 110, 120, 140], [120, 140, 160, 200], [200, 300, 400, 600]])
    gains = torch.tensor([[1.0, 1.3, 1.5, 1.6, 1.65, 1.7, 1.72, 1.74]])
    assert cost_model_budget(gains, prof, 1, 1, 8) == 4
    # Rates by N: 10.0, 11.8, 13.0, 13.3, 13.2, 13.1, 12.7, 12.4 per second: within 5% of the best, 7 is the largest.
    assert cost_model_budget(gains, prof, 1, 1, 8, slack=0.95) == 7
    full_draft = [0.0] + [0.060] * 7  # seconds of drafting for trees of 1..8 nodes
    assert cost_model_budget(gains, prof, 1, 1, 8, full_draft) == 1  # 1.6 / 0.18 < 1 / 0.1
    # Small trees draft fewer depths: cheap enough, they pay where the full tree does not.
    by_depth = [0.0, 0.005, 0.010] + [0.060] * 5
    assert cost_model_budget(gains, prof, 1, 1, 8, by_depth) == 3  # 1.5 / 0.125 > 1.3 / 0.115 > 1 / 0.1
    assert cost_model_budget(gains[:, :2], prof, 1, 1, 8, by_depth) == 2  # no estimate beyond 2 nodes
    # Batch 16: 2 nodes cost 1.5x one step, so a perfect draft (2 tokens) would pay ...
    assert speculation_may_pay(prof, 16, 8, max_depth=4)
    assert not speculation_may_pay(prof, 16, 8, max_depth=4, drafting_s=[0.0] + [0.8] * 7)  # ... but not after 800 ms
    # Where every node costs more than a whole plain step, nothing can pay: no drafting at all.
    steep = table_profile([[100, 110, 120, 140], [120, 140, 160, 200], [200, 450, 900, 1800]])
    assert not speculation_may_pay(steep, 16, 8, max_depth=4)
    assert speculation_may_pay(steep, 1, 8, max_depth=4)


def test_auto_budget_is_concurrency_on_gpus_and_the_cost_model_elsewhere():
    assert resolve_budget("auto", "cuda") == "concurrency"
    assert resolve_budget("auto", "cpu") == "cost_model"
    for policy in ("fixed", "concurrency", "cost_model"):
        assert resolve_budget(policy, "cuda") == resolve_budget(policy, "cpu") == policy
    decoder = SpeculativeDecoder(build_tiny_model(), SpeculationConfig(num_heads=2, profile_cache_len=32))
    assert SpeculationConfig().budget == "auto" and decoder.budget == "cost_model" and decoder.profile is not None


def test_a_tree_steps_own_work_counts_against_speculation(tmp_path, monkeypatch):
    """The profile times forwards only: what a tree step adds beyond its forward over what a plain
    step adds (measured on each generate) is charged to every tree, never credited."""
    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path))
    model = build_tiny_model(seed=0)
    spec = SpeculationConfig(heads_path=None, budget="cost_model", profile_cache_len=32, max_nodes=8)
    engine = RolloutEngine(model, decoder=SpeculativeDecoder(model, spec))
    cost_model = engine.decoder.cost_model
    engine.generate([[5, 9, 13], [7, 8]], SamplingParams(max_new_tokens=24, n=2))
    assert cost_model.plain_extra_s is not None or cost_model.tree_extra_s is not None
    cost_model.plain_extra_s, cost_model.tree_extra_s = 0.002, 0.002
    drafting_only = cost_model.drafting_s()
    cost_model.tree_extra_s = 0.005
    assert [a - b for a, b in zip(cost_model.drafting_s(), drafting_only)] == pytest.approx([0.0] + [0.003] * 7)
    cost_model.tree_extra_s = 0.001  # cheaper than a plain step's extra: no credit
    assert cost_model.drafting_s() == drafting_only


@pytest.mark.parametrize("damage", ['{"model": "tiny-profiled", "dev', "", '{"model": "tiny-profiled", "colour": 1}'])
def test_a_damaged_profile_cache_is_measured_again_with_a_warning_naming_it(tmp_path, monkeypatch, damage):
    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path))
    model = build_tiny_model(seed=0)
    model.config.name = "tiny-profiled"
    path = HardwareProfile.cache_path("tiny-profiled", "cpu", "float32", 16)
    path.parent.mkdir(parents=True)
    path.write_text(damage)  # cut short by a crash, emptied, or of another layout
    with pytest.warns(UserWarning, match=f"hardware profile cache {path} is damaged"):
        measured = get_profile(model, cache_len=16, max_nodes=2)
    assert HardwareProfile.load("tiny-profiled", "cpu", "float32", 16) == measured  # rewritten whole
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
