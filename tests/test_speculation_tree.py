"""Draft trees and the tree-attention pass on a tiny model (docs/algorithm.md, sections 3-4)."""
from __future__ import annotations

import copy

import pytest
import torch

from specroll.data.prompts import format_prompt
from specroll.models import KVCache, build_tiny_model
from specroll.rollout import RolloutEngine, SamplingParams
from specroll.speculation import (
    HorizonHeads,
    SpeculationConfig,
    SpeculativeDecoder,
    draft_candidates,
    select_tree,
    shipped_heads,
    tree_attention_mask,
)
from specroll.speculation.budgets.cost_model import DRAFT_PROBE_EVERY, RARE_PROBE_EVERY, blend
from specroll.speculation.drafting.tree import level_depths
from specroll.speculation.verification.verify import verify_tree


def test_level_depths_numbers_each_depths_candidates_in_drafting_order():
    expected = torch.tensor([1, 2, 2, 2, 3, 3])
    assert torch.equal(level_depths([1, 3, 2], 2, "cpu"), expected.expand(2, -1))
    assert torch.equal(level_depths([4], 1, "cpu"), torch.ones(1, 4, dtype=torch.long))


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(init_std=0.3, seed=1)


def speculative_engine(model, **spec) -> RolloutEngine:
    """An engine of a speculative decoder with these `SpeculationConfig` fields."""
    return RolloutEngine(model, decoder=SpeculativeDecoder(model, SpeculationConfig(**spec)))


def random_heads(model, head_type, seed=0):
    heads = HorizonHeads.for_model(model, head_type, num_heads=3)
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return heads


def prefix_state(model, prompts):
    """Cache of the prompts minus their last token, which becomes each row's root."""
    cache = KVCache.for_model(model, len(prompts), 64)
    width = max(len(p) for p in prompts) - 1
    ids = torch.tensor([p[:-1] + [0] * (width - len(p) + 1) for p in prompts])
    out = model(ids, cache=cache)
    lengths = torch.tensor([len(p) - 1 for p in prompts])
    cache.commit(lengths)
    hidden = out.hidden[torch.arange(len(prompts)), lengths - 1]
    roots = torch.tensor([p[-1] for p in prompts])
    return cache, hidden, roots


@pytest.mark.parametrize("head_type", ["path", "medusa"])
def test_tree_is_connected_within_budget_and_differs_per_row(model, head_type):
    heads = random_heads(model, head_type)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    _, hidden, roots = prefix_state(model, prompts)
    cands = draft_candidates(heads, model, hidden, roots, max_drafts=9, log_calibration=torch.zeros(3))
    tree = select_tree(cands, 9)
    assert tree.tokens.shape == (3, 9)
    for b in range(3):
        for i in range(9):
            parent = int(tree.parents[b, i])
            assert parent <= i  # combined index of the parent precedes the node
            if parent > 0:
                assert int(tree.depths[b, i]) == int(tree.depths[b, parent - 1]) + 1
            else:
                assert int(tree.depths[b, i]) == 1
        siblings = {}
        for i in range(9):
            siblings.setdefault(int(tree.parents[b, i]), []).append(int(tree.tokens[b, i]))
        assert all(len(v) == len(set(v)) for v in siblings.values())  # children carry distinct tokens
    assert not torch.equal(tree.tokens[0], tree.tokens[1])  # sparse: each response its own tree


@pytest.mark.parametrize("head_type", ["path", "medusa"])
def test_drafting_fewer_nodes_gives_the_same_small_trees(model, head_type):
    """A small budget drafts only the depths and widths its tree can use (cheaper at large
    batches); the best-k trees for k up to that number must not change."""
    heads = random_heads(model, head_type, seed=3)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [3, 4]]
    _, hidden, roots = prefix_state(model, prompts)
    full = draft_candidates(heads, model, hidden, roots, max_drafts=9, log_calibration=torch.zeros(3),
                            max_frontier=2)
    for drafted in (1, 2, 3, 5):
        bounded = draft_candidates(heads, model, hidden, roots, max_drafts=drafted,
                                   log_calibration=torch.zeros(3), max_frontier=2)
        assert int(bounded.depths.max()) <= drafted
        assert torch.allclose(bounded.expected_tokens(drafted + 1), full.expected_tokens(drafted + 1))
        for k in range(1, drafted + 1):
            small, large = select_tree(bounded, k), select_tree(full, k)
            for field in ("tokens", "parents", "depths", "valid"):
                assert torch.equal(getattr(small, field), getattr(large, field)), (drafted, k, field)


def test_a_tree_padded_to_a_bucket_is_the_small_tree_followed_by_invalid_nodes(model):
    """A sync-free step keeps the best k of a larger drafting and pads to its node bucket: the
    first k nodes are the k-node tree, field for field, and the padding can never be accepted
    nor seen by the tree (each padding node sees the root and itself only)."""
    heads = random_heads(model, "path", seed=3)
    _, hidden, roots = prefix_state(model, [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]])
    cands = draft_candidates(heads, model, hidden, roots, max_drafts=7, log_calibration=torch.zeros(3))
    for k in (1, 3, 7):
        small, padded = select_tree(cands, k), select_tree(cands, k, 7)
        assert padded.num_drafts == 7
        for field in ("tokens", "parents", "depths", "valid", "head_probs"):
            assert torch.equal(getattr(padded, field)[:, :k], getattr(small, field)), (k, field)
        assert not padded.valid[:, k:].any() and not padded.parents[:, k:].any()
        mask = tree_attention_mask(padded, 3)
        assert torch.equal(mask[:, : k + 1, : k + 1], tree_attention_mask(small, 3))
        assert not mask[:, : k + 1, k + 1:].any()  # no tree node sees the padding


def test_tree_pass_logits_equal_plain_forward_on_each_path_and_compaction_matches_recompute(model):
    heads = random_heads(model, "path", seed=2)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    cache, hidden, roots = prefix_state(model, prompts)
    tree = select_tree(draft_candidates(heads, model, hidden, roots, 7, torch.zeros(3)), 7)
    ids = torch.cat((roots[:, None], tree.tokens), 1)
    positions = cache.lengths[:, None] + torch.cat((torch.zeros(2, 1, dtype=torch.long), tree.depths), 1)
    with torch.no_grad():
        out = model(ids, position_ids=positions, cache=cache, new_token_mask=tree_attention_mask(tree, 3))
    for b, prompt in enumerate(prompts):
        for node in range(8):
            path, v = [], node
            while v > 0:
                path.append(int(tree.tokens[b, v - 1]))
                v = int(tree.parents[b, v - 1])
            sequence = prompt + path[::-1]
            with torch.no_grad():
                reference = model(torch.tensor([sequence])).logits[0, -1]
            torch.testing.assert_close(out.logits[b, node], reference, atol=1e-5, rtol=1e-5)

    # Keep a root-to-leaf path per row, then the next step must equal a full recompute.
    deepest = tree.depths.argmax(dim=1)
    kept = []
    for b in range(2):
        path, v = [], int(deepest[b]) + 1
        while v > 0:
            path.append(v)
            v = int(tree.parents[b, v - 1])
        kept.append([0] + path[::-1])
    width = max(len(k) for k in kept)
    node_index = torch.tensor([k + [k[-1]] * (width - len(k)) for k in kept])
    cache.commit_gather(node_index, torch.tensor([len(k) for k in kept]))
    nxt = torch.tensor([[3], [4]])
    with torch.no_grad():
        step = model(nxt, cache=cache).logits[:, -1]
    for b, prompt in enumerate(prompts):
        sequence = prompt + [int(ids[b, i]) for i in kept[b][1:]] + [int(nxt[b])]
        with torch.no_grad():
            reference = model(torch.tensor([sequence])).logits[0, -1]
        torch.testing.assert_close(step[b], reference, atol=1e-5, rtol=1e-5)


def test_greedy_verification_accepts_exactly_the_argmax_chain(model):
    heads = random_heads(model, "medusa", seed=3)
    cache, hidden, roots = prefix_state(model, [[5, 6, 7, 8]])
    tree = select_tree(draft_candidates(heads, model, hidden, roots, 7, torch.zeros(3)), 7)
    ids = torch.cat((roots[:, None], tree.tokens), 1)
    positions = cache.lengths[:, None] + torch.cat((torch.zeros(1, 1, dtype=torch.long), tree.depths), 1)
    with torch.no_grad():
        out = model(ids, position_ids=positions, cache=cache, new_token_mask=tree_attention_mask(tree, 3))
    logprobs = torch.log_softmax(out.logits.float(), -1)
    verdict = verify_tree(logprobs, tree, None, SamplingParams(temperature=0.0), max_depth=3)
    emitted = verdict.tokens[0, : int(verdict.counts[0])].tolist()
    sequence = [5, 6, 7, 8]
    for token in emitted:
        with torch.no_grad():
            assert token == int(model(torch.tensor([sequence])).logits[0, -1].argmax())
        sequence.append(token)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("head_type", ["path", "medusa"])
def test_greedy_speculative_equals_greedy_plain_with_mixed_prompt_lengths(model_type, head_type):
    model = build_tiny_model(model_type, init_std=0.3, seed=4)
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12], [13]]
    params = SamplingParams(temperature=0, max_new_tokens=40, n=2)
    plain = RolloutEngine(model).generate(prompts, params)
    spec = speculative_engine(model, head_type=head_type, budget="fixed", fixed_nodes=6).generate(prompts, params)
    assert spec.token_ids == plain.token_ids
    assert spec.finish_reasons == plain.finish_reasons
    torch.testing.assert_close(torch.tensor(sum(spec.logprobs, [])), torch.tensor(sum(plain.logprobs, [])), atol=1e-4, rtol=0)


@pytest.mark.parametrize("head_type", ["path", "medusa"])
def test_a_draft_vocabulary_limits_drafts_and_keeps_greedy_output(model, head_type):
    heads = random_heads(model, head_type)
    vocab = torch.arange(0, model.config.vocab_size, 3)  # a third of the tokens
    heads.set_draft_vocab(vocab)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    _, hidden, roots = prefix_state(model, prompts)
    cands = draft_candidates(heads, model, hidden, roots, max_drafts=9, log_calibration=torch.zeros(3))
    assert torch.isin(cands.tokens, vocab).all()
    full = random_heads(model, head_type)
    assert not torch.isin(draft_candidates(full, model, hidden, roots, 9, torch.zeros(3)).tokens, vocab).all()

    params = SamplingParams(temperature=0, max_new_tokens=40, n=2)
    plain = RolloutEngine(model).generate(prompts, params)
    engine = speculative_engine(model, head_type=head_type, heads_path=None, budget="fixed", fixed_nodes=6)
    engine.decoder.set_heads(heads)
    assert engine.generate(prompts, params).token_ids == plain.token_ids


@pytest.mark.parametrize("head_type", ["path", "medusa"])
def test_prepacked_drafting_equals_plain_and_follows_head_policy_and_vocab_updates(head_type):
    model = build_tiny_model(init_std=0.3, seed=1)
    _, hidden, roots = prefix_state(model, [[5, 6, 7, 8], [9, 10, 11]])

    def both(heads):
        plain = draft_candidates(heads.use_prepacked_linears(False), model, hidden, roots, 9, torch.zeros(3))
        packed = draft_candidates(heads.use_prepacked_linears(True), model, hidden, roots, 9, torch.zeros(3))
        assert torch.equal(packed.tokens, plain.tokens) and torch.equal(packed.parents, plain.parents)
        torch.testing.assert_close(packed.scores, plain.scores, rtol=1e-4, atol=1e-5)

    heads = random_heads(model, head_type)
    heads.set_draft_vocab(torch.arange(0, model.config.vocab_size, 2))
    both(heads)
    heads.load_state_dict(random_heads(model, head_type, seed=7).state_dict())  # a published head version
    both(heads)
    heads.set_draft_vocab(torch.arange(1, model.config.vocab_size, 3))
    both(heads)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # the policy moved: drafting reads its LM head, never a stale copy
    both(heads)


def test_seeded_speculative_sampling_is_deterministic(model):
    """Same seed and same decoder state: the same samples. (A reused engine carries its
    acceptance estimates into the next call: its trees differ, not its distribution.)"""
    params = SamplingParams(max_new_tokens=24, n=3, seed=11)
    a, b = (speculative_engine(model, budget="fixed", fixed_nodes=5).generate([[3, 4], [5, 6, 7]], params)
            for _ in range(2))
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_rows_finish_at_different_steps_and_eos_inside_an_accepted_path():
    """EOS-prone model: responses stop at different steps, often in the middle of a tree path."""
    model = build_tiny_model(init_std=0.3, seed=5, eos_token_ids=[1])
    with torch.no_grad():
        model.lm_head.weight[1] += 0.35 * model.lm_head.weight.norm(dim=1).mean()  # make EOS likely
    # Wide trees so paths are often accepted across the EOS.
    engine = speculative_engine(model, budget="fixed", fixed_nodes=16, max_nodes=16, max_children=8)
    out = engine.generate([[3, 4, 5], [6, 7]], SamplingParams(max_new_tokens=30, n=16, seed=0))
    lengths = [len(t) for t in out.token_ids]
    assert len(set(lengths)) > 3
    for tokens, reason in zip(out.token_ids, out.finish_reasons):
        assert 1 not in tokens[:-1]  # nothing after EOS
        assert (reason == "stop") == (tokens[-1] == 1)
        assert reason == "stop" or len(tokens) == 30
    assert out.stats.tree.tokens_per_step_hist.keys() - {1} # multi-token steps happened
    active = out.stats.active_rows_per_step
    assert active == sorted(active, reverse=True) and active[-1] < active[0]


@pytest.mark.parametrize("sync_free", [True, False])
def test_eos_and_the_length_cap_cut_an_accepted_path_where_they_fall(sync_free):
    """A step that accepts past an EOS or past max_new_tokens keeps the response up to it, and the
    decoder's statistics count the tokens the response kept."""
    model = build_tiny_model(init_std=0.3, seed=5, eos_token_ids=[1])
    with torch.no_grad():
        model.lm_head.weight[1] += 0.25 * model.lm_head.weight.norm(dim=1).mean()
    # Sync-free tree steps: finished rows ride along, emitting nothing.
    engine = speculative_engine(model, heads_path=None, budget="fixed", fixed_nodes=16, max_nodes=16, max_children=8,
                                sync_free_trees=sync_free)
    steps = []  # (row ids, tokens each emitted) of every verify step, spied on the real decoder
    real_step = engine.decoder.step

    def recorded_step(state):
        rows, live = state.row_ids.tolist(), state.live.tolist()  # finished rows wait in a sync-free batch
        result = real_step(state)
        emitted = [t[:c] for t, c in zip(result.tokens.tolist(), result.counts.tolist())]
        steps.append(([r for r, alive in zip(rows, live) if alive], [t for t, alive in zip(emitted, live) if alive]))
        return result

    engine.decoder.step = recorded_step
    cap = 12
    out = engine.generate([[3, 4, 5], [6, 7]], SamplingParams(max_new_tokens=cap, n=24, seed=3))
    emitted = {row: [tokens[0]] for row, tokens in enumerate(out.token_ids)}  # the prefill sampled one
    cut_at_eos = cut_at_cap = 0
    for rows, tokens_per_row in steps:
        for row, tokens in zip(rows, tokens_per_row):
            before = len(emitted[row])
            emitted[row] += tokens
            if 1 in tokens[:-1] and before + tokens.index(1) < cap:
                cut_at_eos += 1
                assert out.token_ids[row] == emitted[row][: before + tokens.index(1) + 1]
                assert out.finish_reasons[row] == "stop"
            elif before + len(tokens) > cap and 1 not in emitted[row][:cap]:
                cut_at_cap += 1
                assert out.token_ids[row] == emitted[row][:cap] and out.finish_reasons[row] == "length"
    assert cut_at_eos > 0 and cut_at_cap > 0
    hist = out.stats.tree.tokens_per_step_hist
    assert sum(hist.values()) == sum(len(rows) for rows, _ in steps)  # one count per live row-pass
    # The first token of each response came from the prompt's pass.
    assert sum(k * n for k, n in hist.items()) == sum(len(tokens) - 1 for tokens in out.token_ids)


def test_smollm2_greedy_with_its_shipped_heads_equals_plain_greedy(smollm2, gsm8k_test_questions):
    """The shipped heads load on the model they were made for, draft tokens the policy
    accepts, and leave greedy output unchanged token for token (mixed prompt lengths)."""
    model, tokenizer = smollm2
    heads = HorizonHeads.load(shipped_heads("smollm2-135m-instruct"), model)
    prompts = [format_prompt(tokenizer, q) for q in gsm8k_test_questions[:3]]
    assert len({len(p) for p in prompts}) == 3
    params = SamplingParams(temperature=0, max_new_tokens=32)
    plain = RolloutEngine(model, tokenizer).generate(prompts, params)
    cfg = SpeculationConfig(heads_path=None, budget="fixed", fixed_nodes=8)
    engine = RolloutEngine(model, tokenizer, SpeculativeDecoder(model, cfg))
    engine.decoder.set_heads(heads)
    spec = engine.generate(prompts, params)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.tree.tokens_per_step_mean > 1.3


@pytest.mark.parametrize("sync_free_trees", [False, True])
def test_concurrency_budget_follows_active_rows(model, sync_free_trees):
    """The budget follows the rows live at the last host read: every step where tree steps read,
    every sync_every steps where they do not."""
    cfg = SpeculationConfig(budget="concurrency", capacity=24, min_nodes=1, max_nodes=8, sync_free_trees=sync_free_trees)
    engine = RolloutEngine(model, decoder=SpeculativeDecoder(model, cfg), sync_every=4)
    out = engine.generate([[3, 4, 5]], SamplingParams(max_new_tokens=20, n=12, seed=1))
    sync_every = 4 if sync_free_trees else 1
    read_at = [step - step % sync_every for step in range(len(out.stats.tree.budget_per_step))]
    for budget, step in zip(out.stats.tree.budget_per_step, read_at):
        assert budget == max(1, min(8, 24 // out.stats.active_rows_per_step[step]))


def test_a_one_node_budget_is_a_plain_step(model):
    """N_t = 1 drafts nothing, runs the same one-token forward per row as plain decoding and
    samples the same tokens from the same seeds."""
    prompts, params = [[5, 6, 7, 8], [9, 10, 11]], SamplingParams(max_new_tokens=20, n=3, seed=2)
    engine = speculative_engine(model, heads_path=None, budget="fixed", fixed_nodes=1)
    engine.decoder.draft = lambda *args, **kwargs: pytest.fail("drafted with a one-node budget")
    widths = []
    hook = model.register_forward_pre_hook(lambda module, args: widths.append(args[0].shape[1]))
    try:
        spec = engine.generate(prompts, params)
    finally:
        hook.remove()
    plain = RolloutEngine(model).generate(prompts, params)
    assert spec.token_ids == plain.token_ids
    assert widths[0] == 4 and set(widths[1:]) == {1}  # the prefill, then one token per row per step
    assert spec.stats.tree.verify_steps == plain.stats.steps
    # Finished rows wait in the batch between host reads; the statistics count only live ones.
    assert spec.stats.tree.tokens_per_step_hist == {1: sum(plain.stats.active_rows_per_step)}


def test_cost_model_budget_speculates_where_it_pays_and_stays_exact_in_greedy(model, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path))  # the engine measures and caches a profile
    heads = random_heads(model, "path")
    engine = speculative_engine(model, heads_path=None, budget="cost_model", max_nodes=8)
    engine.decoder.set_heads(heads)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(temperature=0, max_new_tokens=30, n=2)
    out = engine.generate(prompts, params)
    assert out.token_ids == RolloutEngine(model).generate(prompts, params).token_ids
    assert all(1 <= b <= 8 for b in out.stats.tree.budget_per_step)
    assert max(engine.decoder.cost_model.draft_s) > 0  # drafting was timed for the cost model

    # A profile where every extra node costs a whole step: drafting never pays, so it never runs.
    prof = engine.decoder.profile
    prof.latency_s = [[row[0] * n for n in prof.nodes] for row in prof.latency_s]
    engine.decoder.cost_model.draft_s = [0.0] * 4
    engine.decoder.set_heads(heads)
    out = engine.generate(prompts, params)
    assert set(out.stats.tree.budget_per_step) == {1} and max(engine.decoder.cost_model.draft_s) == 0.0


def test_cost_model_drafts_only_where_the_last_estimates_say_it_pays(model, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path))
    cost_model = speculative_engine(model, heads_path=None, budget="cost_model", max_nodes=8).decoder.cost_model
    prof = cost_model.profile
    prof.batch_sizes, prof.nodes = [1, 16], [1, 2, 4, 8]
    prof.latency_s = [[0.100, 0.105, 0.110, 0.120], [0.200, 0.300, 0.400, 0.600]]
    assert cost_model.planned_drafts(1) == 7  # nothing drafted yet: the full tree, to find out
    good = torch.tensor([1.0, 1.4, 1.6, 1.7, 1.75, 1.8, 1.85, 1.9])
    cost_model.expected_per_row, cost_model.typical_per_row = good, good
    assert cost_model.planned_drafts(1) == 7 and cost_model.planned_drafts(16) == 0  # pays alone, not at batch 16
    cost_model.expected_per_row = torch.ones(8)  # the last drafts were never accepted
    assert cost_model.planned_drafts(1) == 0
    cost_model.steps_since_full_draft = DRAFT_PROBE_EVERY
    assert cost_model.planned_drafts(1) == 7  # the heads usually pay alone: a frequent probe
    assert cost_model.planned_drafts(16) == 0  # not even usually at batch 16: a rare probe
    cost_model.steps_since_full_draft = RARE_PROBE_EVERY
    assert cost_model.planned_drafts(16) == 7


def test_cost_model_drafts_only_the_tree_it_plans(model, tmp_path, monkeypatch):
    """Where a small tree is best, a step drafts only that tree's depths; larger trees are
    re-estimated by a full draft every RARE_PROBE_EVERY steps. (Trees here beat plain decoding
    by 3-4%: no margin asked, min_gain=0.)"""
    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path))
    engine = speculative_engine(model, heads_path=None, budget="cost_model", max_nodes=8, min_gain=0.0)
    cost_model = engine.decoder.cost_model
    prof = cost_model.profile
    prof.batch_sizes, prof.nodes = [1, 16], [1, 2, 4, 8]
    prof.latency_s = [[0.100, 0.105, 0.110, 0.120], [0.200, 0.270, 0.500, 0.600]]
    good = torch.tensor([1.0, 1.4, 1.6, 1.7, 1.75, 1.8, 1.85, 1.9])
    cost_model.expected_per_row, cost_model.typical_per_row = good, good
    assert cost_model.planned_drafts(16) == 1  # 1.4 / 0.27 beats 1 / 0.2, and 1.6 / 0.385 is not within 10% of it
    cost_model.draft_s = [0.0, 0.0, 0.0, 0.0, 0.050]  # a full draft (4 depths) took 50 ms
    assert cost_model.drafting_s() == pytest.approx([0.0, 0.0125, 0.025, 0.0375] + [0.050] * 4)  # scaled by depth
    assert cost_model.planned_drafts(16) == 0  # with its depth's share of that, even 2 nodes would not pay
    cost_model.draft_s[1] = 0.002  # but a one-depth draft was measured at 2 ms
    assert cost_model.planned_drafts(16) == 1
    cost_model.steps_since_full_draft = DRAFT_PROBE_EVERY
    assert cost_model.planned_drafts(16) == 1  # a tree is planned: larger ones are probed rarely
    cost_model.steps_since_full_draft = RARE_PROBE_EVERY
    assert cost_model.planned_drafts(16) == 7


def test_estimates_of_larger_trees_follow_the_largest_drafted_one():
    average = torch.tensor([1.0, 1.5, 1.8, 2.0])
    assert torch.allclose(blend(average, torch.tensor([1.0, 1.7]), 0.5), torch.tensor([1.0, 1.6, 1.9, 2.1]))
    assert torch.allclose(blend(average, torch.tensor([1.0, 1.1, 1.2, 1.4]), 0.5), torch.tensor([1.0, 1.3, 1.5, 1.7]))


def test_a_later_version_of_the_heads_keeps_the_drafting_estimates(model):
    """A slow-path update swaps in a close variant of the heads: how well they draft need not be
    learned again (restarting the calibration cost every update a round of uncalibrated trees)."""
    engine = speculative_engine(model, heads_path=None, budget="fixed", fixed_nodes=4)
    decoder, heads = engine.decoder, random_heads(model, "path")
    decoder.set_heads(heads)
    engine.generate([[9, 10, 11]], SamplingParams(temperature=0, max_new_tokens=20))
    observed, predicted = decoder.estimates.observed.clone(), decoder.estimates.predicted.clone()
    assert not torch.equal(observed, torch.ones(3))  # calibrated by the verify passes
    update = copy.deepcopy(heads)
    update.version = heads.version + 1
    decoder.set_heads(update)
    kept = decoder.estimates
    assert decoder.heads is update and torch.equal(kept.observed, observed) and torch.equal(kept.predicted, predicted)
    decoder.set_heads(random_heads(model, "path", seed=1))  # other heads (version 0) start afresh
    fresh = decoder.estimates
    assert torch.equal(fresh.observed, torch.ones(3)) and torch.equal(fresh.predicted, torch.ones(3))


def cost_model_engine(model, tmp_path, monkeypatch, latency_s) -> tuple[RolloutEngine, list[int]]:
    """A cost-model engine on a 2 x 4 profile with these latencies, and the list of verify
    steps at which it drafts (filled as it generates)."""
    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path))
    engine = speculative_engine(model, heads_path=None, budget="cost_model", max_nodes=8)
    decoder = engine.decoder
    decoder.profile.batch_sizes, decoder.profile.nodes = [1, 16], [1, 2, 4, 8]
    decoder.profile.latency_s = latency_s
    drafted_at = []
    draft = decoder.draft

    def counting_draft(state, max_drafts):
        drafted_at.append(decoder.step_log.verify_steps)
        return draft(state, max_drafts)

    monkeypatch.setattr(decoder, "draft", counting_draft)
    return engine, drafted_at


def test_cost_model_probes_rarely_where_the_heads_never_pay(model, tmp_path, monkeypatch):
    # Perfect drafts would pay (2 tokens for 1.5 steps' time), so probes stay on ...
    engine, drafted_at = cost_model_engine(model, tmp_path, monkeypatch, [[1.0, 1.5, 2.5, 4.5], [2.0, 3.0, 5.0, 9.0]])
    decoder, prof = engine.decoder, engine.decoder.profile
    decoder.estimates.observed.fill_(0.01)  # ... but these heads' drafts are believed almost never accepted.
    out = engine.generate([[9, 10, 11]], SamplingParams(temperature=0, max_new_tokens=61))  # 60 decode steps
    assert out.stats.tree.verify_steps == 60 and set(out.stats.tree.budget_per_step) == {1}
    # Probing every DRAFT_PROBE_EVERY steps would draft 12 times.
    assert drafted_at == [0, 17, 34, 51]

    prof.latency_s = [[1.0, 0.01, 0.01, 0.01], [2.0, 0.02, 0.02, 0.02]]  # now any tree pays
    drafted_at.clear()
    out = engine.generate([[9, 10, 11]], SamplingParams(temperature=0, max_new_tokens=30))
    assert max(out.stats.tree.budget_per_step) > 1 and len(drafted_at) == out.stats.tree.verify_steps  # every step


def test_cost_model_recovers_from_a_slow_first_draft(model, tmp_path, monkeypatch):
    """A cold first draft (kernels loading on a GPU) must not switch speculation off for good."""
    any_tree_pays = [[1.0, 0.01, 0.01, 0.01], [2.0, 0.02, 0.02, 0.02]]
    engine, drafted_at = cost_model_engine(model, tmp_path, monkeypatch, any_tree_pays)
    decoder = engine.decoder
    # ... unless drafting takes as long as this first one did
    decoder.cost_model.draft_s = [0.0] + [100.0] * decoder.heads.num_heads
    out = engine.generate([[9, 10, 11]], SamplingParams(temperature=0, max_new_tokens=40))
    budgets = out.stats.tree.budget_per_step
    # A rare probe re-measures drafting, after which every step drafts and speculates.
    assert drafted_at[0] == RARE_PROBE_EVERY and set(budgets[:RARE_PROBE_EVERY]) == {1}
    assert drafted_at == list(range(RARE_PROBE_EVERY, len(budgets))) and min(budgets[RARE_PROBE_EVERY:]) > 1
    # Far below the cold 100 s; about 1 s stays, since this profile's plain step (1 s) dwarfs its
    # tree steps (0.01 s) and the cost model counts the difference as a tree step's own work.
    assert max(decoder.cost_model.drafting_s()) < 2.0



def test_heads_of_another_depth_count_their_own_depths(model):
    """Swapping in heads of fewer depths between generate calls restarts the per-depth counters."""
    engine = speculative_engine(model, heads_path=None, budget="fixed", fixed_nodes=4, sync_free_trees=True)
    params = SamplingParams(max_new_tokens=12, n=2, seed=4)
    assert len(engine.generate([[3, 4, 5]], params).stats.tree.acceptance_by_depth) == 4
    engine.decoder.set_heads(HorizonHeads.for_model(model, "path", 2))
    assert len(engine.generate([[3, 4, 5]], params).stats.tree.acceptance_by_depth) == 2


def test_the_heads_form_names_their_structure_dtype_and_packing_not_their_weights():
    """What compiled drafting guards on in place of the heads' modules (see `compiled_step.specialise`)."""
    model = build_tiny_model("llama", seed=0)
    a, b = HorizonHeads.for_model(model, "path", num_heads=3), HorizonHeads.for_model(model, "path", num_heads=3)
    with torch.no_grad():
        next(b.parameters()).add_(1)
    assert a.form == b.form
    assert HorizonHeads.for_model(model, "path", num_heads=2).form != a.form
    b.set_draft_vocab(torch.arange(10))
    assert b.form != a.form
    b.set_draft_vocab(None)
    assert b.use_prepacked_linears().form != a.form
    assert copy.deepcopy(a).to(torch.bfloat16).form != a.form
