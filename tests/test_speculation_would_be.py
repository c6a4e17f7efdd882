"""Would-be trees: scored by hand, and against the same drafts run as real trees on a tiny model."""
from __future__ import annotations

import pytest
import torch

from specroll.models import build_tiny_model
from specroll.rollout import RolloutEngine, SamplingParams
from specroll.speculation import HorizonHeads, SpeculationConfig, SpeculativeDecoder
from specroll.speculation.budgets.cost_model import CostModel
from specroll.speculation.budgets.hardware_profile import HardwareProfile
from specroll.speculation.drafting.tree import DraftTree
from specroll.speculation.verification.would_be import WouldBeTrees

# root -> 5 (node 1) -> 7 (node 3) -> 2 (node 4); root -> 6 (node 2). Ranks: node i has rank i - 1.
TREE = DraftTree(tokens=torch.tensor([[5, 6, 7, 2]]), parents=torch.tensor([[0, 0, 1, 3]]),
                 depths=torch.tensor([[1, 1, 2, 3]]), valid=torch.ones(1, 4, dtype=torch.bool),
                 head_probs=torch.tensor([[0.5, 0.25, 0.5, 0.5]]), candidates=torch.tensor([[0, 1, 2, 3]]))
RANKS = torch.tensor([[0, 1, 2, 3]])
# Emitted after the root, one row each: the whole chain and its bonus, the second child then a
# miss, a miss at the root, the chain left at depth 2.
EMITTED = [[5, 7, 2, 9], [6, 3, 0, 0], [4, 0, 0, 0], [5, 7, 3, 0]]
# Tokens per pass by tree size 1..5 (a size holds the nodes of rank below size - 1).
BY_SIZE = [[1, 2, 2, 3, 4], [1, 1, 2, 2, 2], [1, 1, 1, 1, 1], [1, 2, 2, 3, 3]]


def started(rows: int) -> WouldBeTrees:
    trees = WouldBeTrees(nodes=5, max_depth=3, device="cpu")
    expand = lambda t: t.expand(rows, -1)  # noqa: E731
    tree = DraftTree(*(expand(getattr(TREE, f)) for f in ("tokens", "parents", "depths", "valid", "head_probs", "candidates")))
    trees.start(torch.arange(rows), tree, expand(RANKS), torch.ones(rows, dtype=torch.bool))
    return trees


def test_a_hand_built_tree_scores_the_path_the_emitted_tokens_follow():
    trees, rows = started(4), torch.arange(4)
    finished = torch.zeros(4, dtype=torch.bool)
    for k in range(4):  # plain steps, one token each
        done = trees.advance(rows, torch.tensor([[e[k]] for e in EMITTED]), torch.ones(4, dtype=torch.long))
        finished |= done.done
    assert finished.all() and trees.advance(rows, torch.zeros(4, 1, dtype=torch.long), torch.ones(4)) is None
    sums, passes = trees.pop_sums()
    assert passes == 4 and sums == [float(sum(col)) for col in zip(*BY_SIZE)]  # 4 + 2 + 1 + 3 at 5 nodes
    # Calibration signals as a verdict's: depth 1 accepted by rows 0, 1, 3; mass under the root 0.75.
    assert trees.accepted[:, 0].tolist() == [True, True, False, True]
    assert trees.mass[:, 0].tolist() == [0.75] * 4 and trees.mass[1, 1] == 0.0 and trees.mass[0, 1] == 0.5


def test_tokens_a_tree_step_emits_at_once_score_alike():
    trees, rows = started(4), torch.arange(4)
    # A tree step emitting 2 tokens per row, then plain steps; row 2's second token came after its tree was done.
    trees.advance(rows, torch.tensor([e[:2] for e in EMITTED]), torch.full((4,), 2))
    for k in (2, 3):
        trees.advance(rows, torch.tensor([[e[k]] for e in EMITTED]), torch.ones(4, dtype=torch.long))
    assert trees.pop_sums() == ([float(sum(col)) for col in zip(*BY_SIZE)], 4)


def test_a_row_without_emissions_keeps_its_tree_and_rows_are_kept_by_id():
    trees = started(2)
    # Row 1 alone, first in a compacted batch; row 0 emits nothing (finished, riding along).
    trees.advance(torch.tensor([1]), torch.tensor([[6]]), torch.ones(1, dtype=torch.long))
    trees.advance(torch.tensor([1, 0]), torch.tensor([[3], [5]]), torch.tensor([1, 0]))
    assert trees.active.tolist() == [True, False]
    assert trees.pop_sums() == ([2.0, 2.0, 3.0, 3.0, 3.0], 2)  # row 0's tree, cut short at its row's end, counts 1


def test_would_be_scores_teach_the_cost_model():
    prof = HardwareProfile("m", "cpu", "float32", 16, [1, 4], [1, 2, 4, 8], [[1.0, 1.1, 1.2, 1.4]] * 2)
    model = CostModel(prof, depth=3, min_nodes=1, max_nodes=8, min_gain=0.0)
    model.note_would_be(torch.tensor([1.0, 1.05, 1.1, 1.1, 1.15]))
    assert model.expected_per_row.tolist() == pytest.approx([1.0, 1.05, 1.1, 1.1, 1.15, 1.15, 1.15, 1.15])
    assert model.best_budget(model.expected_per_row, 1) == 1  # no tree's tokens outgrow its time: plain
    for _ in range(30):
        model.note_would_be(torch.tensor([1.0, 1.9, 2.1, 2.3, 2.5]))
    assert model.best_budget(model.expected_per_row, 1) > 1  # trees would carry enough: they pay


VOCAB, EOS = 8, 1
PROMPTS = [[3, 5, 2], [2, 6], [4, 4, 7, 3, 0, 5]]


def random_heads(model) -> HorizonHeads:
    heads = HorizonHeads.for_model(model, "path", 4)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return heads


def test_would_be_yield_agrees_with_the_same_drafts_run_as_trees():
    """Plain decoding scoring a would-be tree at every step against fixed 8-node trees of the same
    heads: same responses, and tokens per pass within 3% (issue 51)."""
    model = build_tiny_model(vocab_size=VOCAB, eos_token_ids=[EOS], init_std=0.2, seed=3).requires_grad_(False)
    params = SamplingParams(n=100, max_new_tokens=24, seed=0, temperature=1.0)
    runs = {}
    for name, spec in (("trees", dict(budget="fixed")), ("plain", dict(budget="concurrency", capacity=1, would_be_every=1))):
        cfg = SpeculationConfig(heads_path=None, fixed_nodes=8, max_nodes=8, context_lookup=False, **spec)
        runs[name] = RolloutEngine(model, decoder=SpeculativeDecoder(model, cfg, heads=random_heads(model))).generate(PROMPTS, params)
    trees, plain = runs["trees"].stats.tree, runs["plain"].stats.tree
    assert runs["trees"].token_ids == runs["plain"].token_ids
    assert set(plain.budget_per_step) == {1} and set(trees.budget_per_step) == {8}
    assert plain.would_be_nodes == 8 and plain.would_be_passes > 1000 and trees.would_be_passes == 0
    assert trees.tokens_per_step_mean > 1.3  # the drafts carry something to agree on
    assert plain.would_be_tokens_per_step == pytest.approx(trees.tokens_per_step_mean, rel=0.03)


def test_a_tree_with_fewer_nodes_than_asked_is_padded_with_invalid_ones():
    trees = WouldBeTrees(nodes=5, max_depth=3, device="cpu")
    small = DraftTree(TREE.tokens[:, :2], TREE.parents[:, :2], TREE.depths[:, :2], TREE.valid[:, :2],
                      TREE.head_probs[:, :2], TREE.candidates[:, :2])
    trees.start(torch.arange(1), small, RANKS[:, :2], torch.ones(1, dtype=torch.bool))
    for token in (5, 7):
        trees.advance(torch.arange(1), torch.tensor([[token]]), torch.ones(1, dtype=torch.long))
    assert trees.pop_sums() == ([1.0, 2.0, 2.0, 2.0, 2.0], 1)


def test_a_first_tree_after_the_batch_was_compacted_finds_room_for_its_rows():
    trees = WouldBeTrees(nodes=5, max_depth=3, device="cpu")
    tree = DraftTree(*(getattr(TREE, f).expand(2, -1) for f in ("tokens", "parents", "depths", "valid", "head_probs", "candidates")))
    rows = torch.tensor([3, 6])  # rows 0-2, 4, 5 had finished and were compacted away
    trees.start(rows, tree, RANKS.expand(2, -1), torch.ones(2, dtype=torch.bool))
    trees.advance(rows, torch.tensor([[6], [4]]), torch.ones(2, dtype=torch.long))
    trees.advance(rows, torch.tensor([[3], [0]]), torch.ones(2, dtype=torch.long))
    assert trees.pop_sums() == ([2.0, 2.0, 3.0, 3.0, 3.0], 2)
