"""What a speculative rollout hands the slow path: telemetry and a bounded sample of matured records."""
from __future__ import annotations

import math

import pytest
import torch

from specroll.models import build_tiny_model
from specroll.rollout import RolloutEngine, SamplingParams
from specroll.speculation import SpeculationConfig, SpeculativeDecoder
from specroll.speculation.adaptation.head_records import sketch_tv_and_nll, target_top
from specroll.speculation.adaptation.maturation import MaturedProposals, node_paths, tree_proposals
from specroll.speculation.drafting.heads import draft_policy_top
from specroll.speculation.drafting.tree import DraftTree, Proposal
from specroll.speculation.verification.verify import Verdict


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(vocab_size=64, init_std=0.1, seed=3).requires_grad_(False)


def slow_path_rollout(model, params, cap=10_000, record_nodes="path"):
    cfg = SpeculationConfig(heads_path=None, budget="fixed", fixed_nodes=8, adaptation="slow", records_per_rollout=cap,
                     record_nodes=record_nodes)
    engine = RolloutEngine(model, decoder=SpeculativeDecoder(model, cfg))
    out = engine.generate([[3, 4, 5], [6, 7], [9, 1, 2, 8]], params)
    return out, *engine.decoder.pop_head_records()


def test_greedy_records_hold_the_policy_at_the_right_position(model):
    """In greedy decoding every emitted token is the policy's argmax: a record's realised token is
    its target's top token, and h_t through the LM head gives the root on its path."""
    out, telemetry, records = slow_path_rollout(model, SamplingParams(temperature=0, max_new_tokens=40, n=2))
    records.validate()
    assert len(records) == int(telemetry.records.sum()) > 50  # no cap reached: every matured record kept
    assert (records.token == records.target_ids[:, 0]).all()
    root = (records.hidden.float() @ model.lm_head.weight.T).argmax(dim=1)
    assert (root == records.path_tokens[:, 0]).all()
    assert (records.target_logp.exp().sum(1) + records.target_tail.exp()).sub(1).abs().max() < 1e-4
    assert set(records.head.tolist()) <= set(range(4)) and (records.head_version == 0).all()
    # Each record names the response it came from (its index in the output), which holds its token.
    assert len(set(records.response.tolist())) > 1
    assert all(t in out.token_ids[r] for t, r in zip(records.token.tolist(), records.response.tolist()))
    # Telemetry counts every verified draft; acceptance is what verification decided.
    assert telemetry.trials.sum() > 0 and telemetry.accepted.sum() <= telemetry.trials.sum()


def test_records_are_a_bounded_sample(model):
    params = SamplingParams(temperature=1.0, max_new_tokens=40, n=4, seed=0)
    _, telemetry, everything = slow_path_rollout(model, params)
    _, _, sample = slow_path_rollout(model, params, cap=40)
    assert len(sample) == 40 < len(everything) == int(telemetry.records.sum())
    kept = {tuple(r.tolist()) for r in torch.cat((everything.path_tokens, everything.token[:, None]), 1)}
    assert all(tuple(r.tolist()) in kept for r in torch.cat((sample.path_tokens, sample.token[:, None]), 1))


def test_sketch_tv_and_nll_by_hand():
    # Target top-2 {0: 0.5, 1: 0.3} (rest 0.2); head sketch {0: 0.6, 2: 0.3} (rest 0.1).
    target_logp, target_ids = torch.tensor([[0.5, 0.3]]).log(), torch.tensor([[0, 1]])
    head_logp, head_ids = torch.tensor([[0.6, 0.3]]).log(), torch.tensor([[0, 2]])
    tv, nll = sketch_tv_and_nll(target_logp, target_ids, head_logp, head_ids, torch.tensor([2]), torch.tensor([0.1]).log())
    # |0.5 - 0.6| + |0.3 - 0| + q(2) = 0.3 + |rest 0.2 - rest 0.1| -> TV = 0.5 * (0.1 + 0.3 + 0.3 + 0.1) = 0.4
    torch.testing.assert_close(tv, torch.tensor([0.4]))
    torch.testing.assert_close(nll, -torch.tensor([0.3]).log())
    _, nll = sketch_tv_and_nll(target_logp, target_ids, head_logp, head_ids, torch.tensor([5]), torch.tensor([0.1]).log())
    torch.testing.assert_close(nll, -torch.tensor([0.1]).log())  # outside the sketch: the tail's mass


def test_the_policy_over_a_draft_vocabulary_by_hand():
    """The policy's distribution as heads with a draft vocabulary see it: renormalised over it."""
    logits = torch.tensor([[[0.0, math.log(3.0), 5.0, math.log(1.0)]],
                           [[0.0, float("-inf"), 5.0, float("-inf")]]])  # row 1: top-k cut the vocabulary
    row, node = torch.tensor([0, 1]), torch.tensor([0, 0])
    top_logp, top_ids, log_normaliser = draft_policy_top(logits, row, node, torch.tensor([3, 1]), k=2)
    assert torch.allclose(top_logp[0].exp(), torch.tensor([0.75, 0.25])) and top_ids[0].tolist() == [1, 3]
    assert torch.allclose(log_normaliser[0], torch.tensor([math.log(4.0)]))  # logits[.., 1] - it = log 0.75
    assert (top_logp[1] == float("-inf")).all() and log_normaliser[1].item() == float("-inf")
    top_logp, top_ids, _ = draft_policy_top(logits[:1], row[:1], node[:1], None, k=4)  # no vocabulary: all tokens
    assert torch.allclose(top_logp, torch.log_softmax(logits[0], dim=-1).sort(descending=True).values)


def test_tree_records_add_the_verified_nodes_off_the_path(model):
    """record_nodes="tree": the path's records (with their realised token) plus every other node a
    head drafted from, which has none; every record still starts from the root it was drafted at."""
    params = SamplingParams(temperature=0, max_new_tokens=40, n=2)
    _, telemetry, path = slow_path_rollout(model, params)
    _, _, tree = slow_path_rollout(model, params, record_nodes="tree")
    tree.validate()
    on_path = tree.token >= 0
    assert int(on_path.sum()) == len(path) == int(telemetry.records.sum())
    assert (~on_path).sum() > 0
    assert (tree.token[on_path] == tree.target_ids[on_path, 0]).all()  # greedy: the realised token is the top one
    root = (tree.hidden.float() @ model.lm_head.weight.T).argmax(dim=1)
    assert (root == tree.path_tokens[:, 0]).all()
    with pytest.raises(ValueError, match="record_nodes"):
        SpeculationConfig(heads_path=None, record_nodes="everything")


def hand_tree():
    """Root 10; node 1 = 11 and node 2 = 12 below it, node 3 = 13 below node 1 (candidates 0, 1, 2).
    Heads drafted from the root, from nodes 1 and 2, and from node 3; the path accepts node 2."""
    tree = DraftTree(tokens=torch.tensor([[11, 12, 13]]), parents=torch.tensor([[0, 0, 1]]),
                     depths=torch.tensor([[1, 1, 2]]), valid=torch.ones(1, 3, dtype=torch.bool),
                     head_probs=torch.ones(1, 3), candidates=torch.tensor([[0, 1, 2]]))
    sketch = lambda f: (torch.zeros(1, f, 2), torch.zeros(1, f, 2, dtype=torch.long))  # noqa: E731
    proposals = [Proposal(torch.tensor([[-1]]), *sketch(1)), Proposal(torch.tensor([[0, 1]]), *sketch(2)),
                 Proposal(torch.tensor([[2]]), *sketch(1))]
    verdict = Verdict(path=torch.tensor([[0, 2, 2]]), counts=torch.tensor([2]), tokens=torch.tensor([[12, 40, 0]]),
                      logprobs=torch.zeros(1, 3), accepted_at_depth=torch.tensor([[True, False]]),
                      reached_node_prob=torch.zeros(1, 2))
    return tree, proposals, verdict


def test_tree_proposals_and_node_paths_by_hand():
    tree, proposals, verdict = hand_tree()
    matured, on_path = tree_proposals(proposals, tree, verdict)
    assert matured.depth.tolist() == [0, 1, 1, 2] and matured.node.tolist() == [0, 1, 2, 3]
    assert on_path.tolist() == [True, False, True, False]
    assert matured.children.tolist() == [[11, 12, -1], [-1, -1, 13], [-1, -1, -1], [-1, -1, -1]]
    assert node_paths(tree, torch.tensor([10]), 3).tolist() == [[[10, 0, 0], [10, 11, 0], [10, 12, 0], [10, 11, 13]]]


def test_targets_over_a_draft_vocabulary_are_its_columns_renormalised():
    """A record's target is the policy restricted to the draft vocabulary (any order of ids),
    computed on those columns alone: the same top tokens and log-probs as over the full row."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 64, generator=g) * 3
    vocab = torch.randperm(64, generator=g)[:40]  # not sorted
    row, node = torch.tensor([0, 1, 2, 2]), torch.tensor([0, 3, 1, 2])
    matured = MaturedProposals(row=row, node=node, depth=torch.zeros(4, dtype=torch.long),
                               head_logp=torch.zeros(4, 1), head_ids=torch.zeros(4, 1, dtype=torch.long),
                               children=torch.full((4, 1), -1))
    logp, ids = target_top(logits, matured, vocab)
    at_nodes = logits[row, node]  # the reference: the full rows, -inf outside the vocabulary, renormalised
    padded = torch.full_like(at_nodes, float("-inf")).index_copy(-1, vocab, at_nodes[:, vocab])
    reference_logp, reference_ids = torch.log_softmax(padded, dim=-1).topk(32, dim=-1)
    assert torch.allclose(logp, reference_logp, atol=1e-6) and torch.equal(ids, reference_ids)
    assert set(ids.flatten().tolist()) <= set(vocab.tolist())
