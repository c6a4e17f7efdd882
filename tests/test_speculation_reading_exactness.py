"""Statistical exactness of speculative rollouts whose trees read the coming draws (the Gumbel
sampler with `speculation.read_draws`; docs/algorithm.md, section 2, and speculation/drafting/reading.py).

The tiny 8-token Llama of test_speculation_exactness.py, its heads distilled from it, and the
Gumbel sampler's first stage cut to the 4 likeliest tokens, so both stages draw. Every kept token
still follows the policy (token and rank tests, the plain responses). The acceptance calibration
changes its null: a tree that read its draws hits more often than its drafted mass, so the blind
null must fail, and the exact chance given the draws' noise (`exactness.gumbel_hit_chance`) must
hold, also against an acceptance rule that leaks.
"""
from __future__ import annotations

import numpy as np
import pytest
from exactness import (
    assert_plain_responses,
    bonferroni_min,
    decision_draws,
    decisions_of,
    exactness_pvalues,
    gumbel_hit_chance,
    hf_oracle,
)
from test_speculation_exactness import EOS, FAIL_P, NEW_TOKENS, NUM_HEADS, PASS_P, PROMPTS, VOCAB, Setting, leaky
from test_speculation_exactness import heads as heads  # noqa: F401  (the module's trained heads, as a fixture here)
from test_speculation_exactness import speculative_rollout

from specroll.models import build_tiny_model
from specroll.rollout import SamplingParams, samplers
from specroll.speculation.verification.verify import verify_tree

CANDIDATES = 4  # the Gumbel stage's tokens: half the vocabulary, so the inverse-CDF stage draws too

READING = {
    "t1-path-trained-fixed8": Setting(dict(temperature=1.0, sampler="gumbel"), "path-trained",
                                      dict(budget="fixed", fixed_nodes=8), n=600, min_deep_share=0.1),
    "t07-topp09-medusa-trained-fixed16-siblings": Setting(dict(temperature=0.7, top_p=0.9, sampler="gumbel"),
                                                         "medusa-trained",
                                                         dict(budget="fixed", fixed_nodes=16, sibling_lookup=True),
                                                         n=1000, min_deep_share=0.1),
}
QUICK = "t1-path-trained-fixed8"


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("llama", vocab_size=VOCAB, eos_token_ids=[EOS], init_std=0.2, seed=3).requires_grad_(False)


@pytest.fixture(scope="module")
def oracle(model):
    return hf_oracle(model)


@pytest.fixture(scope="module")
def rollouts(model, oracle, heads):
    """Each setting's rollout under `rule` with its decisions and their chance of a hit given the noise."""
    made = {}

    def get(name: str, rule=verify_tree):
        if (name, rule) not in made:
            setting = READING[name]
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(samplers, "GUMBEL_CANDIDATES", CANDIDATES)
                out, recorder, params = speculative_rollout(model, heads[setting.heads], setting, rule)
            dec = decisions_of(oracle, PROMPTS, out, recorder, params, setting.n)
            made[name, rule] = out, dec, gumbel_hit_chance(dec, decision_draws(dec, params.seed, setting.n), CANDIDATES)
        return made[name, rule]

    return get


def tiered(names):
    return [name if name == QUICK else pytest.param(name, marks=pytest.mark.statistics) for name in names]


@pytest.mark.parametrize("name", tiered(READING))
def test_reading_trees_emit_the_policys_tokens_and_hit_as_the_noise_says(model, rollouts, name):
    out, dec, chance = rollouts(name)
    setting = READING[name]
    blind = exactness_pvalues(dec, NUM_HEADS)
    reading = exactness_pvalues(dec, NUM_HEADS, chance)
    print(f"{name}: {len(dec.tokens)} tokens, {out.stats.tree.tokens_per_step_mean:.2f} per verify step; "
          f"reading null {reading}; blind null {blind}")
    assert bonferroni_min(reading) > PASS_P, reading
    # The blind null (hits as often as the drafted mass) is wrong for trees that read the draws.
    assert blind["acceptance"] < FAIL_P and blind["acceptance_pooled"] < FAIL_P, blind
    hit = dec.drafted[np.arange(len(dec.tokens)), dec.tokens]
    assert hit.mean() > (dec.probs * dec.drafted).sum(axis=1).mean() + 0.05  # reading drafts hit more than blind mass
    assert np.bincount(dec.depth, minlength=NUM_HEADS + 1)[2:].sum() >= setting.min_deep_share * len(dec.tokens)
    params = dict(n=setting.n, max_new_tokens=NEW_TOKENS, seed=0, **setting.sampling)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(samplers, "GUMBEL_CANDIDATES", CANDIDATES)
        assert_plain_responses(model, PROMPTS, out, SamplingParams(**params))


def test_a_leaky_rule_on_reading_trees_fails_the_null_that_knows_the_noise(rollouts):
    """Negative control: accepting the first child at 2% of the nodes whatever the draw."""
    _, dec, chance = rollouts(QUICK, leaky(0.02))
    pvalues = exactness_pvalues(dec, NUM_HEADS, chance)
    print(f"leak-2% on reading trees: {pvalues}")
    assert bonferroni_min(pvalues) < FAIL_P, pvalues
