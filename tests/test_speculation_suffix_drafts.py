"""Group siblings and earlier responses as draft sources, on a real tiny model: their drafts are
accepted where the texts agree, responses stay the plain ones, and the history is kept per prompt."""
import pytest

from specroll.models import build_tiny_model
from specroll.rollout import RolloutEngine, SamplingParams
from specroll.speculation import SpeculationConfig, SpeculativeDecoder
from specroll.speculation.drafting.suffix_drafts import merged_history, prompt_digest

PROMPTS = [[3, 5, 2, 9, 10], [2, 6, 7]]
GROUP = 8


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(vocab_size=64, eos_token_ids=[1], init_std=0.2, seed=3).requires_grad_(False)


def engine(model, **spec):
    cfg = SpeculationConfig(heads_path=None, budget="fixed", fixed_nodes=8, max_nodes=8, **spec)
    return RolloutEngine(model, decoder=SpeculativeDecoder(model, cfg))


def greedy(seed=0):
    return SamplingParams(n=GROUP, max_new_tokens=48, seed=seed, temperature=0.0)


def test_sibling_drafts_alone_are_accepted_in_a_greedy_group(model):
    """T = 0: every sibling writes the same text in lockstep, so a sibling holds what comes next
    only where the text repeats itself; with no heads and no context lookup, only sibling chains
    are drafted, and they are accepted, two drafts deep at times."""
    out = engine(model, head_drafts=False, context_lookup=False, sibling_lookup=True).generate(PROMPTS, greedy())
    assert out.token_ids == RolloutEngine(model).generate(PROMPTS, greedy()).token_ids
    tree = out.stats.tree
    assert tree.tokens_per_step_mean > 1.15, tree.tokens_per_step_hist
    assert tree.tokens_per_step_hist.get(3, 0) > 0


def test_history_drafts_carry_a_repeated_prompt_to_full_depth(model):
    """The second call on the same prompts finds the first call's responses: at T = 0 they are
    its own, and nearly every verify pass accepts the whole chain (4 drafts and the bonus token)."""
    spec = engine(model, head_drafts=False, context_lookup=False, history_lookup=True)
    first = spec.generate(PROMPTS, greedy())
    spec.decoder.learn_from_responses(PROMPTS, first.token_ids, GROUP)
    second = spec.generate(PROMPTS, greedy(seed=1))
    assert second.token_ids == first.token_ids
    assert first.stats.tree.tokens_per_step_mean == 1.0  # nothing to draft from yet
    assert second.stats.tree.tokens_per_step_mean > 4.0, second.stats.tree.tokens_per_step_hist


def test_t1_responses_are_the_plain_ones_with_every_source_on(model):
    params = SamplingParams(n=GROUP, max_new_tokens=32, seed=4, temperature=1.0)
    spec = engine(model, sibling_lookup=True, history_lookup=True)
    for _ in range(2):
        out = spec.generate(PROMPTS, params)
        spec.decoder.learn_from_responses(PROMPTS, out.token_ids, GROUP)
        assert out.token_ids == RolloutEngine(model).generate(PROMPTS, params).token_ids


def test_history_is_kept_per_prompt_with_its_bounds(model):
    spec = engine(model, history_lookup=True, history_tokens_per_prompt=60, history_tokens=60)
    spec.decoder.learn_from_responses(PROMPTS, [[7] * 20] * (2 * GROUP), GROUP)
    state = spec.decoder.suffix.history_state()
    # Each text is the prompt's last lookup_ngram tokens and the response; 23 tokens: two fit per
    # in all, and the first prompt's texts are the oldest, evicted for the second's.
    assert [(key, len(tokens)) for key, _, tokens in state["texts"]] == [(prompt_digest(PROMPTS[1]), 23)] * 2
    assert state["next_text"] == 2 * GROUP
    assert state["texts"][0][2][:3] == PROMPTS[1][-3:]
    merged = merged_history([state, state])
    assert [number for _, number, _ in merged["texts"]] == [0, 1, 2, 3] and merged["next_text"] == 4


def test_history_needs_its_switch_and_a_draft_source():
    with pytest.raises(ValueError, match="^head_drafts must be true when every lookup is off, got False: nothing would be drafted$"):
        SpeculationConfig(head_drafts=False, context_lookup=False)
    with pytest.raises(ValueError, match="^history_tokens must be an int >= 20, got 10: history_tokens_per_prompt is what one"):
        SpeculationConfig(history_tokens=10, history_tokens_per_prompt=20)
