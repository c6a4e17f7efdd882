"""The FastGRPO-style drafter: its tree rule on hand-worked cases, tree drafting against drafting
one path at a time, the features a rollout logs, and saving / loading."""
from __future__ import annotations

import pytest
import torch

from specroll.fastgrpo import FastGRPOConfig, FastGRPODecoder, FeatureDrafter, teacher_forced_sequences
from specroll.fastgrpo.decoder import DrafterCall
from specroll.fastgrpo.tree_rule import TreeShape, levels_worth_drafting, nodes_per_response, tree_shape
from specroll.models import build_tiny_model
from specroll.rollout import RolloutEngine, SamplingParams

PROMPTS = [[3, 5, 2], [2, 6], [4, 4, 7, 3, 0, 5]]


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(vocab_size=16, eos_token_ids=[1], init_std=0.2, seed=3).requires_grad_(False)


@pytest.mark.parametrize("capacity, rows, max_nodes, nodes", [
    (160, 16, 160, 10), (160, 1, 160, 160), (160, 1, 64, 64), (160, 200, 160, 2), (2, 16, 160, 2), (33, 8, 160, 4),
])
def test_nodes_per_response(capacity, rows, max_nodes, nodes):
    """N = max(2, min(floor(C / B), N_max))."""
    assert nodes_per_response(capacity, rows, max_nodes) == nodes


@pytest.mark.parametrize("nodes, shape, levels", [
    (2, TreeShape(2, 3, 1), 1),  # log2(2.67) = 1.4 -> 1, clamped up to 3 levels; one draft: one level is enough
    (4, TreeShape(4, 3, 3), 3),  # log2(5.33) = 2.4 -> 2 -> 3
    (10, TreeShape(10, 3, 8), 3),  # log2(13.3) = 3.7 -> 3; K = min(9, 8)
    (23, TreeShape(23, 4, 8), 4),  # log2(30.7) = 4.94 -> 4
    (24, TreeShape(24, 5, 8), 5),  # log2(32) = 5
    (160, TreeShape(160, 5, 8), 5),  # log2(213) = 7.7, clamped down to 5
])
def test_tree_shape(nodes, shape, levels):
    assert tree_shape(nodes) == shape
    assert levels_worth_drafting(shape) == levels


def test_drafted_scores_are_the_drafters_path_log_probabilities(model):
    """Every drafted node's score equals the sum of the drafter's log-probabilities along its path,
    computed one path at a time with plain causal attention: the tree attention over the drafter's
    own cache sees exactly each node's ancestors, and children are distinct."""
    drafter = FeatureDrafter.for_model(model, seed=5)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    decoder = FastGRPODecoder(model, FastGRPOConfig(drafter_path=None, capacity=1000, max_nodes=24))
    decoder.set_drafter(drafter)
    batch, dim = 2, model.config.hidden_size
    hidden, first = torch.randn(batch, dim, generator=g), torch.tensor([5, 9])
    base = torch.tensor([4, 7])  # each row's prompt length: its first token's position
    call = DrafterCall(drafter.new_cache(batch, 64), hidden[:, None], first[:, None], torch.ones(batch, dtype=torch.long),
                       None)
    shape = tree_shape(24)
    with torch.inference_mode():
        cands = decoder.draft(call, decoder.catch_up(call, base), base, shape, levels_worth_drafting(shape))
    assert int(cands.depths.max()) == shape.depth == 5
    embed, lm_head = model.embed_tokens.weight, model.lm_head.weight
    for row in range(batch):
        parents, tokens = cands.parents[row].tolist(), cands.tokens[row].tolist()
        children = [(p, t) for p, t in zip(parents, tokens)]
        assert len(set(children)) == len(children)  # distinct tokens under each parent
        for node in range(len(tokens)):
            path = [node]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            path = path[::-1]
            features, toks, score = hidden[row][None], [int(first[row])], 0.0
            with torch.no_grad():
                for depth, c in enumerate(path):
                    positions = int(base[row]) - 1 + torch.arange(len(toks))
                    predicted = drafter(features[None], embed[torch.tensor(toks)][None], positions[None])[0, -1]
                    score += float(torch.log_softmax(predicted @ lm_head.T, -1)[tokens[c]])
                    features, toks = torch.cat((features, predicted[None])), toks + [tokens[c]]
            assert float(cands.scores[row, node]) == pytest.approx(score, abs=1e-4)


def test_a_rollout_logs_the_policys_features_at_every_response_position(model):
    cfg = FastGRPOConfig(drafter_path=None, capacity=1000, max_nodes=8)
    engine = RolloutEngine(model, decoder=FastGRPODecoder(model, cfg))
    out = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=20, n=3, seed=2))
    logged = engine.decoder.pop_training_data(out.token_ids)
    assert engine.decoder.pop_training_data(out.token_ids) is None  # popped once
    rows = [r for r in range(len(out.token_ids)) if len(out.token_ids[r]) >= 2]
    forced = teacher_forced_sequences(model, [PROMPTS[r // 3] for r in rows], [out.token_ids[r] for r in rows])
    assert len(logged) == len(forced) == len(rows) and logged.num_entries == forced.num_entries
    by_key = {(tuple(forced.tokens[i, : int(forced.lengths[i])].tolist()), int(forced.start_positions[i])): i
              for i in range(len(forced))}
    for i in range(len(logged)):
        n = int(logged.lengths[i])
        j = by_key[(tuple(logged.tokens[i, :n].tolist()), int(logged.start_positions[i]))]
        torch.testing.assert_close(logged.features[i, :n], forced.features[j, :n], atol=1e-5, rtol=1e-4)


def test_save_and_load(model, tmp_path):
    drafter = FeatureDrafter.for_model(model, seed=1)
    drafter.updates = 3
    drafter.save(tmp_path / "d.safetensors", dtype=torch.bfloat16)
    loaded = FeatureDrafter.load(tmp_path / "d.safetensors", model)
    assert loaded.updates == 3 and loaded.fc.weight.dtype == torch.float32
    for name, value in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value.to(torch.bfloat16).float())
    other = build_tiny_model(vocab_size=32, seed=3)
    with pytest.raises(ValueError, match="was made for model llama-L2-D32-V16"):
        FeatureDrafter.load(tmp_path / "d.safetensors", other)
    with pytest.raises(FileNotFoundError, match="drafter file not found"):
        FeatureDrafter.load(tmp_path / "missing.safetensors", model)
