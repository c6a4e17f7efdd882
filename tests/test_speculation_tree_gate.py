"""The tree gate: sync-free trees sized by a measured capacity run only where their tokens pay."""
from __future__ import annotations

import collections
import copy

import pytest
import torch

from specroll.models import build_tiny_model
from specroll.rollout import RolloutEngine, SamplingParams
from specroll.speculation import HorizonHeads, SpeculationConfig, SpeculativeDecoder
from specroll.speculation.budgets import tree_gate
from specroll.speculation.budgets.hardware_profile import HardwareProfile
from specroll.speculation.budgets.tree_gate import TreeGate, trees_pay
from specroll.speculation.warmup import tree_form


def table_profile(plain_ms: float, tree_ms: float) -> HardwareProfile:
    """A profile of tree steps whose plain steps cost `plain_ms` and trees `tree_ms` at every batch size."""
    nodes = [1, 2, 4, 8, 16]
    latency = [[(plain_ms if n == 1 else tree_ms) / 1e3 for n in nodes] for _ in range(2)]
    return HardwareProfile("m", "cpu", "float32", 256, [1, 4096], nodes, latency, tree_form="trees")


def by_tokens(*counts: int, max_tokens: int = 5) -> torch.Tensor:
    """Live row-steps that emitted k = 0..max_tokens tokens."""
    return torch.tensor(list(counts) + [0] * (max_tokens + 1 - len(counts)))


def test_trees_pay_when_their_tokens_per_row_outrun_their_cost():
    # 1.8 tokens in 15 ms = 120/s against 100/s plain: 20% better, more than 5%.
    assert trees_pay(1.8, plain_s=0.010, tree_s=0.015, min_gain=0.05)
    # 1.5 tokens in 15 ms = 100/s: no better than plain.
    assert not trees_pay(1.5, plain_s=0.010, tree_s=0.015, min_gain=0.05)
    # 1.6 tokens: 6.7% better, short of a 10% margin.
    assert trees_pay(1.6, 0.010, 0.015, 0.05) and not trees_pay(1.6, 0.010, 0.015, 0.10)


def test_the_gate_estimates_tokens_per_live_row_by_bucket_and_closes_where_trees_lose():
    gate = TreeGate([4, 8, 16], max_tokens=5, min_gain=0.05, device="cpu")
    profile = table_profile(plain_ms=10, tree_ms=15)
    assert gate.allows(profile, 8, 4)  # nothing measured: trees run to find out
    for _ in range(tree_gate.READ_EVERY - 1):
        gate.note_tree(4, by_tokens(0, 2, 2))  # 4 live rows emit 1, 1, 2, 2 tokens
    assert gate.tokens_per_row(4) is None  # not read yet: no host read every step
    gate.note_tree(4, by_tokens(0, 2, 2))
    assert gate.tokens_per_row(4) == 1.5 and gate.tokens_per_row(8) is None
    assert not gate.allows(profile, 8, 4)  # 1.5 tokens for 1.5x a plain step's cost
    assert gate.allows(profile, 8, 8)  # another bucket: unmeasured
    assert gate.allows(table_profile(plain_ms=10, tree_ms=12), 8, 4)  # 1.5 for 1.2x pays


def test_where_a_bucket_loses_a_smaller_one_that_pays_runs():
    gate = TreeGate([4, 8, 16], max_tokens=16, min_gain=0.05, device="cpu")
    # Plain 10 ms; trees of 4 nodes 15 ms, of 8 nodes 30 ms, of 16 nodes 40 ms.
    profile = HardwareProfile("m", "cpu", "float32", 256, [1, 4096], [1, 4, 8, 16],
                              [[0.010, 0.015, 0.030, 0.040]] * 2, tree_form="trees")
    gate.tokens, gate.rows = [1.8, 2.2, 3.0], [1.0, 1.0, 1.0]  # tokens per row of each bucket's trees
    assert gate.largest_allowed(profile, 4, 16) == 4  # 3.0 for 4x and 2.2 for 3x lose; 1.8 for 1.5x pays
    assert gate.largest_allowed(profile, 4, 8) == 4
    gate.tokens[0] = 1.5
    assert gate.largest_allowed(profile, 4, 16) is None  # nothing pays: a plain step


def test_a_closed_gate_probes_and_reads_the_probe_at_once():
    gate = TreeGate([4], max_tokens=5, min_gain=0.05, device="cpu")
    profile = table_profile(plain_ms=10, tree_ms=15)
    gate.tokens, gate.rows = [2.0], [2.0]  # two rows read so far, a token each
    for _ in range(tree_gate.PROBE_EVERY - 1):
        assert not gate.allows(profile, 1, 4)
        gate.note_plain()
    gate.note_plain()
    assert gate.allows(profile, 1, 4)  # the probe
    gate.note_tree(4, by_tokens(0, 0, 0, 0, 1))  # one row accepted 3 drafts
    d = tree_gate.DECAY  # the old rows count for d each: (2d + 4) / (2d + 1) tokens per row
    assert gate.tokens_per_row(4) == pytest.approx((2 * d + 4) / (2 * d + 1))
    assert gate.allows(profile, 1, 4)  # 2.5 tokens for 1.5x: open again
    gate.reset()
    assert gate.tokens_per_row(4) is None and gate.steps_without == [0]


def test_probes_that_leave_the_gate_closed_come_ever_less_often():
    gate = TreeGate([4], max_tokens=5, min_gain=0.05, device="cpu")
    profile = table_profile(plain_ms=10, tree_ms=15)
    gate.tokens, gate.rows = [1.0], [1.0]  # a token per row: closed

    def plain_steps_to_a_probe() -> int:
        steps = 0
        while not gate.allows(profile, 1, 4):
            gate.note_plain()
            steps += 1
        gate.note_tree(4, by_tokens(0, 1))  # the probe: a token again
        return steps

    first, longest = tree_gate.PROBE_EVERY, tree_gate.MAX_PROBE_EVERY
    waits = [plain_steps_to_a_probe() for _ in range(6)]
    assert waits[:2] == [first, 2 * first] and waits[-2:] == [longest, longest]
    gate.note_tree(4, by_tokens(0, 1))  # trees back to back: the gate was open
    assert plain_steps_to_a_probe() == first
    plain_steps_to_a_probe()
    gate.heads_updated()  # a slow-path update: look again soon
    assert plain_steps_to_a_probe() == first


def test_a_closed_bucket_is_probed_while_a_smaller_ones_trees_run():
    gate = TreeGate([4, 8], max_tokens=5, min_gain=0.05, device="cpu")
    profile = HardwareProfile("m", "cpu", "float32", 256, [1, 4096], [1, 4, 8],
                              [[0.010, 0.015, 0.030]] * 2, tree_form="trees")
    gate.tokens, gate.rows = [2.0, 2.0], [1.0, 1.0]  # 2 tokens per row: pays for 4 nodes, not for 8
    runs = []
    for _ in range(4 * tree_gate.PROBE_EVERY):
        bucket = gate.largest_allowed(profile, 1, 8)
        runs.append(bucket)
        gate.note_tree(bucket, by_tokens(0, 0, 1))  # two tokens a row, whichever bucket
    probes = [step for step, bucket in enumerate(runs) if bucket == 8]
    first = tree_gate.PROBE_EVERY
    assert probes == [first, first + 1 + 2 * first]  # after 64 steps without its trees, then 128
    assert set(runs) == {4, 8}
    # Both closed: one probe an interval, of the larger bucket, not one of each.
    gate.reset()
    gate.tokens, gate.rows = [1.0, 1.0], [1.0, 1.0]
    runs = []
    for _ in range(4 * first):
        bucket = gate.largest_allowed(profile, 1, 8)
        runs.append(bucket)
        gate.note_plain() if bucket is None else gate.note_tree(bucket, by_tokens(0, 1))
    assert [(step, bucket) for step, bucket in enumerate(runs) if bucket] == [(first, 8), (first + 1 + 2 * first, 8)]


def test_capacity_of_a_tree_step_profile_is_measured_from_its_smallest_tree():
    # Batch 1: plain 10 ms, trees 30 ms up to 8 nodes, 40 at 16; batch 4: 35 ms up to 4 nodes.
    prof = HardwareProfile("m", "cpu", "float32", 256, [1, 4], [1, 2, 4, 8, 16],
                           [[0.010, 0.030, 0.030, 0.030, 0.040], [0.012, 0.035, 0.035, 0.050, 0.080]],
                           tree_form="trees")
    assert prof.derive_capacity() == 16  # 4 rows x 4 nodes within 1.25x of the 2-node tree at batch 1
    prof.tree_form = ""
    assert prof.derive_capacity() == 4  # against the plain step only the plain cells fit
    paths = {HardwareProfile.cache_path("m", "cpu", "float32", 256, True, form) for form in ("", "a", "b")}
    assert len(paths) == 3  # other trees, other profiles


def test_a_tree_step_profile_continues_each_column_past_its_largest_batch():
    # Plain steps 10 -> 20 ms and trees 30 -> 50 ms from batch 1 to 4: at batch 7, 30 and 70 ms.
    prof = HardwareProfile("m", "cpu", "float32", 256, [1, 4], [1, 2], [[0.010, 0.030], [0.020, 0.050]],
                           tree_form="trees")
    assert prof.latency(7, 1) == pytest.approx(0.030) and prof.latency(7, 2) == pytest.approx(0.070)


@pytest.fixture
def profile_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path))


def gated_engine(**spec) -> RolloutEngine:
    model = build_tiny_model(seed=0, eos_token_ids=[])  # every response runs to its cap
    cfg = SpeculationConfig(heads_path=None, budget="concurrency", sync_free_trees=True, profile_cache_len=32,
                            max_nodes=8, **spec)
    return RolloutEngine(model, decoder=SpeculativeDecoder(model, cfg))


def test_a_sync_free_decoder_profiles_whole_tree_steps_and_gates_its_trees(profile_cache):
    engine = gated_engine()
    decoder = engine.decoder
    assert decoder.profile.tree_form == tree_form(decoder.heads, decoder.depth, decoder.cfg)
    assert decoder.gate is not None
    assert decoder.profile.nodes == [1, 2, 4, 8]  # no cell beyond the largest tree (max_nodes 8)
    # Untrained heads: trees emit about a token per row. Where they cost twice a plain step the gate closes.
    decoder.profile, decoder.capacity = table_profile(plain_ms=10, tree_ms=20), 64
    params = SamplingParams(max_new_tokens=160, seed=3)
    first = engine.generate([[5, 9, 13], [7, 8]], params)
    assert first.stats.tree.budget_per_step[: tree_gate.READ_EVERY] == [8] * tree_gate.READ_EVERY
    assert decoder.gate.tokens_per_row(8) < 2
    budgets = collections.Counter(engine.generate([[5, 9, 13], [7, 8]], params).stats.tree.budget_per_step)
    assert budgets[8] <= 1 + budgets[1] // tree_gate.PROBE_EVERY and budgets[1] > 100  # plain but for probes
    # Where trees cost less than plain steps, the same drafts pay.
    decoder.profile = table_profile(plain_ms=10, tree_ms=5)
    assert set(engine.generate([[5, 9, 13], [7, 8]], params).stats.tree.budget_per_step) == {8}


def test_new_heads_start_the_gate_afresh_and_an_update_of_the_same_heads_keeps_it(profile_cache):
    decoder = gated_engine().decoder
    decoder.gate.tokens, decoder.gate.rows = [3.0] * 3, [2.0] * 3
    update = copy.deepcopy(decoder.heads)
    update.version += 1
    decoder.set_heads(update)
    assert decoder.gate.tokens_per_row(8) == 1.5
    decoder.set_heads(HorizonHeads.for_model(decoder.model, "path", 4))
    assert decoder.gate.tokens_per_row(8) is None


def test_a_capacity_set_by_hand_or_a_least_tree_sizes_trees_without_a_gate(profile_cache):
    assert gated_engine(capacity=16).decoder.gate is None  # no profile measured
    assert gated_engine(min_nodes=2).decoder.gate is None  # trees asked for at every step
