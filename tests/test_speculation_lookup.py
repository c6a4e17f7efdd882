"""Context lookup drafts (specroll/speculation/drafting/lookup.py) and the token history they read."""
from __future__ import annotations

import math

import pytest
import torch

from specroll.models import build_tiny_model
from specroll.rollout import RolloutEngine, SamplingParams
from specroll.rollout.token_history import TokenHistory
from specroll.speculation import SpeculationConfig, SpeculativeDecoder
from specroll.speculation.drafting.lookup import LookupAcceptance, LookupDrafts, add_lookup_candidates, lookup_drafts
from specroll.speculation.drafting.tree import Candidates, no_candidates, select_tree


def approx(values):
    return pytest.approx(values, abs=1e-6)


def padded(rows: list[list[int]], width: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    return tokens, torch.tensor([len(r) for r in rows])


def test_lookup_drafts_follow_the_latest_longest_earlier_match():
    tokens, lengths = padded([
        [5, 6, 7, 8, 5, 6],  # [8, 5, 6] never seen before; [5, 6] at 0: continue with 7, 8, 5
        [1, 2, 9, 1, 2, 4, 1, 2],  # [1, 2] at 0 and 3: the latest one, followed by 4, 1, 2
        [3, 3],  # [3] at 0, followed by the last token only: the draft stops where the text does
        [1, 2, 3],  # nothing repeats
        [5, 0],  # the padding (zeros) after the row is not text: no match for [0]
    ])
    drafts = lookup_drafts(tokens, lengths, max_ngram=3, depth=3)
    assert drafts.ngram.tolist() == [2, 2, 1, 0, 0]
    assert drafts.valid.tolist() == [[True] * 3, [True] * 3, [True, False, False], [False] * 3, [False] * 3]
    assert drafts.tokens[:3][drafts.valid[:3]].tolist() == [7, 8, 5, 4, 1, 2, 3]
    assert lookup_drafts(tokens, lengths, max_ngram=1, depth=3).ngram.tolist() == [1, 1, 1, 0, 0]


def hand_candidates() -> Candidates:
    """Heads drafted 10 (p .5) and 11 (p .3) at depth 1, and 20 under 10 (p .4)."""
    return Candidates(tokens=torch.tensor([[10, 11, 20]]), parents=torch.tensor([[-1, -1, 0]]),
                      depths=torch.tensor([[1, 1, 2]]), scores=torch.tensor([[0.5, 0.3, 0.2]]).log(),
                      head_probs=torch.tensor([[0.5, 0.3, 0.4]]))


def test_lookup_chain_shares_the_heads_nodes_it_follows_and_adds_the_rest():
    chain = LookupDrafts(torch.tensor([[10, 21, 30]]), torch.ones(1, 3, dtype=torch.bool), torch.tensor([2]))
    merged = add_lookup_candidates(hand_candidates(), chain, torch.tensor([[0.6, 0.5, 0.5]]).log())
    # 10 is shared: either drafter may be right, 1 - (1 - .5)(1 - .6) = .8; 21 and 30 are new,
    # below 10 and 21, scored by the chain alone.
    assert merged.scores.exp()[0, :3].tolist() == approx([0.8, 0.3, 0.2])
    assert math.isinf(merged.scores[0, 3]) and merged.scores[0, 3] < 0  # no new node for the shared 10
    assert merged.tokens[0, 4:].tolist() == [21, 30] and merged.parents[0, 4:].tolist() == [0, 4]
    assert merged.scores.exp()[0, 4:].tolist() == approx([0.3, 0.15])
    # Best 4 of .8 / .3 (depth 1) / .3 (depth 2) / .2 / .15: 10, 11, 20 and 21; 20 and 21 are siblings.
    tree = select_tree(merged, 4)
    assert tree.tokens.tolist() == [[10, 11, 20, 21]] and tree.parents.tolist() == [[0, 0, 1, 1]]


def test_rows_without_a_lookup_match_keep_the_heads_tree():
    none = LookupDrafts(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.bool), torch.tensor([0]))
    merged = add_lookup_candidates(hand_candidates(), none, torch.zeros(1, 3))
    for k in (1, 2, 3):
        a, b = select_tree(merged, k), select_tree(hand_candidates(), k)
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()


def test_a_second_chain_shares_only_usable_nodes_of_the_first():
    """A chain without a match leaves unusable nodes under the root at depths 1..3 holding
    whatever tokens; a later chain through the same tokens must not take them for its own nodes."""
    unmatched = LookupDrafts(torch.tensor([[7, 8, 9]]), torch.zeros(1, 3, dtype=torch.bool), torch.tensor([0]))
    first = add_lookup_candidates(hand_candidates(), unmatched, torch.zeros(1, 3))
    second = add_lookup_candidates(first, LookupDrafts(torch.tensor([[9, 8]]), torch.ones(1, 2, dtype=torch.bool),
                                                       torch.tensor([1])), torch.tensor([[0.5, 0.5]]).log())
    assert second.tokens[0, 6:].tolist() == [9, 8] and second.depths[0, 6:].tolist() == [1, 2]
    assert second.parents[0, 6:].tolist() == [-1, 6] and torch.isinf(second.scores[0, 3:6]).all()
    # No candidate set: every node of the chain is new.
    from_nothing = add_lookup_candidates(no_candidates(torch.tensor([4])), LookupDrafts(
        torch.tensor([[9, 8]]), torch.ones(1, 2, dtype=torch.bool), torch.tensor([1])), torch.tensor([[0.5, 0.5]]).log())
    assert from_nothing.tokens.tolist() == [[9, 8]] and from_nothing.parents.tolist() == [[-1, 0]]
    assert from_nothing.scores.exp().tolist() == [approx([0.5, 0.25])]


def test_lookup_acceptance_learns_from_the_emitted_tokens():
    acceptance = LookupAcceptance(max_ngram=3, depth=3, momentum=0.5, device="cpu", prior=0.3)
    chains = LookupDrafts(torch.tensor([[7, 8, 9], [5, 6, 7]]), torch.ones(2, 3, dtype=torch.bool), torch.tensor([2, 2]))
    # Row 0 emitted 7, 8 on the chain then 4 (3 tokens); row 1 emitted 4 only (1 token).
    on_chain = acceptance.update(chains, torch.tensor([[7, 8, 4, 0], [4, 0, 0, 0]]), torch.tensor([3, 1]))
    assert on_chain.tolist() == [[True, True, False], [False, False, False]]
    # 2-token matches: depth 1 accepted 1 of 2, depth 2 1 of 1, depth 3 0 of 1 (floored at 1e-3).
    assert acceptance.rate[1].tolist() == approx([0.4, 0.65, 0.1505])
    assert acceptance.rate[0].tolist() == approx([0.3] * 3) and acceptance.rate[2].tolist() == approx([0.3] * 3)
    assert acceptance.step_logp(chains).exp().flatten().tolist() == approx([0.4, 0.65, 0.1505] * 2)


def test_token_history_appends_what_rows_emit_and_follows_kept_rows():
    history = TokenHistory.from_prompts([[1, 2], [3]], capacity=5, device="cpu")
    history.repeat_rows(2)
    history.append(torch.tensor([[7, 8, 9], [7, 0, 0], [4, 5, 6], [9, 9, 9]]), torch.tensor([3, 1, 2, 3]))
    history.append(torch.tensor([[1, 1], [2, 2], [3, 3], [4, 4]]), torch.tensor([2, 1, 1, 2]))
    rows = [history.tokens[r, : history.lengths[r]].tolist() for r in range(4)]
    # Row 0 reached its capacity of 5 ids: the rest is not written.
    assert rows == [[1, 2, 7, 8, 9], [1, 2, 7, 2], [3, 4, 5, 3], [3, 9, 9, 9, 4]]
    history.keep(torch.tensor([3, 1]))
    assert history.lengths.tolist() == [5, 4] and history.tokens[1, :4].tolist() == [1, 2, 7, 2]


def test_engine_history_is_prompt_plus_emitted_tokens_at_every_step():
    model = build_tiny_model(seed=2)
    engine = RolloutEngine(model, decoder=SpeculativeDecoder(model, SpeculationConfig(heads_path=None, budget="fixed",
                                                                                      fixed_nodes=6)))
    prompts = [[3, 4, 5, 6], [7, 8]]
    seen = []
    step = engine.decoder.step

    def recording_step(state):
        seen.append([(int(r), state.history.tokens[i, : state.history.lengths[i]].tolist())
                     for i, r in enumerate(state.row_ids)])
        return step(state)

    engine.decoder.step = recording_step
    out = engine.generate(prompts, SamplingParams(max_new_tokens=20, n=2, seed=4))
    assert len(seen) > 3
    for rows in seen:
        for r, ids in rows:
            prompt = prompts[r // 2]
            assert ids[: len(prompt)] == prompt and ids[len(prompt):] == out.token_ids[r][: len(ids) - len(prompt)]


def test_context_lookup_drafts_are_accepted_where_text_repeats_and_greedy_output_is_unchanged():
    """A tiny random model under greedy decoding falls into loops: lookup drafts them ahead."""
    model = build_tiny_model(seed=5)
    prompts, params = [[3, 4, 5, 6, 7], [9, 10]], SamplingParams(temperature=0, max_new_tokens=48, n=1)
    plain = RolloutEngine(model).generate(prompts, params)
    specs = {lookup: SpeculationConfig(heads_path=None, budget="fixed", fixed_nodes=6, context_lookup=lookup)
             for lookup in (False, True)}
    runs = {lookup: RolloutEngine(model, decoder=SpeculativeDecoder(model, spec)).generate(prompts, params)
            for lookup, spec in specs.items()}
    assert runs[True].token_ids == plain.token_ids == runs[False].token_ids
    trees = {lookup: out.stats.tree for lookup, out in runs.items()}
    assert trees[False].lookup_token_share == 0
    assert trees[True].lookup_token_share > 0.5
    assert trees[True].tokens_per_step_mean > trees[False].tokens_per_step_mean + 0.5
