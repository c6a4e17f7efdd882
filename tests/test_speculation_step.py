"""The speculative step's two forms (speculation/step.py) agree: from the same decode state, the
tree step that reads on the host and the sync-free one emit the same tokens, keep the same
accepted paths in the cache, move the state alike and learn the same estimates and counts."""
from __future__ import annotations

import copy

import pytest
import torch

from specroll.models import build_tiny_model
from specroll.rollout import RolloutEngine, SamplingParams
from specroll.speculation import SpeculationConfig, SpeculativeDecoder

PROMPTS = [[3, 5, 2, 9, 3, 5], [2, 6, 2, 6, 2], [4, 4, 7, 3, 0, 5, 10]]


@pytest.fixture(scope="module")
def model():
    # A 12-token vocabulary and peaky distributions that repeat themselves: the heads' drafts (the
    # LM head alone, untrained) and the lookup chain's are often accepted as deep as a tree goes.
    return build_tiny_model("llama", seed=5, init_std=1.0, vocab_size=12, eos_token_ids=[1]).requires_grad_(False)


def snapshots(model, cfg: SpeculationConfig, params: SamplingParams) -> list:
    """Copies of a generate call's decode state before each of its steps (tree steps that read)."""
    engine = RolloutEngine(model, decoder=SpeculativeDecoder(model, cfg))
    states, step = [], engine.decoder.step

    def copying(state):
        states.append(copy.deepcopy(state))
        return step(state)

    engine.decoder.step = copying
    engine.generate(PROMPTS, params)
    return states


@pytest.mark.parametrize("fixed_nodes, context_lookup", [(4, True), (8, True), (8, False), (3, False)])
@pytest.mark.parametrize("sampling", ["t1", "greedy"])
def test_the_reading_and_the_sync_free_tree_step_agree(model, fixed_nodes, context_lookup, sampling):
    """Both forms step from every state of a generate call, each keeping its own running estimates:
    trees of their bucket's size, and a tree below it (3 nodes drafted for the 4-node bucket, padded
    with an invalid node, kept in the cache 4 wide). Below a bucket the sync-free step may choose
    another tree (the lookup chain drafted deeper, the heads' tied scores; `step.draft_step`) and
    then emits the same responses in other steps (test_rollout_compiled_step); not here."""
    params = SamplingParams(max_new_tokens=40, n=2, seed=11, temperature=0.0 if sampling == "greedy" else 1.0)
    spec = dict(heads_path=None, budget="fixed", fixed_nodes=fixed_nodes, max_nodes=8, context_lookup=context_lookup)
    reading, sync_free = (SpeculativeDecoder(model, SpeculationConfig(sync_free_trees=mode, **spec)) for mode in (False, True))
    assert reading.sync_free is None and sync_free.sync_free is not None
    longest = 0
    for start in snapshots(model, SpeculationConfig(**spec), params):
        read_state, free_state = copy.deepcopy(start), copy.deepcopy(start)
        read_out, free_out = reading.step(read_state), sync_free.step(free_state)
        assert torch.equal(read_out.counts, free_out.counts) and torch.equal(read_out.tokens, free_out.tokens)
        torch.testing.assert_close(read_out.logprobs, free_out.logprobs)
        longest = max(longest, int(read_out.counts.max()))
        # The cache holds the same accepted paths (slots past a row's length are never read).
        lengths = read_state.cache.lengths
        assert torch.equal(lengths, free_state.cache.lengths)
        for a, b in zip(read_state.cache.k + read_state.cache.v, free_state.cache.k + free_state.cache.v):
            for row, length in enumerate(lengths.tolist()):
                torch.testing.assert_close(a[row, :, :length], b[row, :, :length])
        torch.testing.assert_close(read_state.last_hidden, free_state.last_hidden)
        assert torch.equal(read_state.rng.counters, free_state.rng.counters)
        assert read_state.cached_bound == free_state.cached_bound
        # What the pass taught.
        torch.testing.assert_close(reading.estimates.observed, sync_free.estimates.observed)
        torch.testing.assert_close(reading.estimates.predicted, sync_free.estimates.predicted)
        torch.testing.assert_close(reading.estimates.lookup_acceptance.rate, sync_free.estimates.lookup_acceptance.rate)
        assert torch.equal(reading.pass_counts.totals, sync_free.pass_counts.totals)
    assert longest == min(fixed_nodes, 4 + 1)  # a tree accepted as deep as 4 heads draft, and the bonus token
    assert not torch.equal(reading.estimates.observed, torch.ones(4))  # and the calibration moved
    assert reading.step_log.budget_per_step == sync_free.step_log.budget_per_step
