"""The FastGRPO-style decoder passes SpecRoll's statistical exactness tests (docs/algorithm.md, sections 2, 8).

Same tiny policy, prompts and statistics as `test_speculation_exactness.py` (see `exactness.py`): every
kept token of thousands of responses, at every tree depth, against its exact conditional from
transformers' forward; an untrained (random) and a pretrained drafter; T=1, T=0.7 with top-p,
top-k; FastGRPO's concurrency rule as rows finish; greedy and sampled output equal plain decoding's; and a
biased acceptance rule fails the same tests with these trees.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from exactness import (
    DecisionRecorder,
    assert_plain_responses,
    bonferroni_min,
    decisions_of,
    exactness_pvalues,
    hf_oracle,
    tiered,
)

from specroll.fastgrpo import FastGRPOConfig, FastGRPODecoder, FeatureDrafter, OnlineConfig
from specroll.fastgrpo.pretrain import pretrain_drafter, sample_features
from specroll.models import build_tiny_model
from specroll.rollout import RolloutEngine, SamplingParams
from specroll.speculation.drafting.tree import DraftTree
from specroll.speculation.head_training.samples import SampleConfig, collect_samples
from specroll.speculation.verification.verify import Verdict, verify_tree

VOCAB, EOS, NEW_TOKENS = 8, 1, 24
PROMPTS = [[3, 5, 2], [2, 6], [4, 4, 7, 3, 0, 5]]
PASS_P, FAIL_P = 1e-4, 1e-6
MAX_DEPTH = 5  # FastGRPOConfig.max_depth: the deepest decision a verify pass can make


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(vocab_size=VOCAB, eos_token_ids=[EOS], init_std=0.2, seed=3).requires_grad_(False)


@pytest.fixture(scope="module")
def oracle(model):
    return hf_oracle(model)


@pytest.fixture(scope="module")
def drafters(model, tmp_path_factory):
    """An untrained drafter with large random weights (many rejections) and one pretrained on the policy's samples."""
    untrained = FeatureDrafter.for_model(model, seed=7)
    g = torch.Generator(torch.get_default_device()).manual_seed(7)
    with torch.no_grad():
        for p in untrained.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    samples = collect_samples(model, PROMPTS, SampleConfig(positions=3000, prompts_per_batch=3, samples_per_prompt=64,
                                                           max_new_tokens=8), tmp_path_factory.mktemp("s"), progress=False)
    trained = FeatureDrafter.for_model(model)
    pretrain_drafter(model, trained, sample_features(model, samples.sequences), 5, OnlineConfig(lr=3e-3, batch_tokens=256),
                     log=lambda _: None)
    return {"untrained": untrained, "trained": trained}


@dataclass(frozen=True)
class Setting:
    sampling: dict  # SamplingParams fields
    drafter: str  # key of the `drafters` fixture
    max_nodes: int  # N_max
    capacity: int = 10**6  # C; the default gives every row N_max nodes
    n: int = 1500  # responses per prompt
    min_deep_share: float = 0.0  # kept tokens from decisions at depth >= 2 must be at least this share


SETTINGS = {
    # 6 nodes: K = 5 of the 8 tokens per level, 3 levels (depth 1 is not always accepted).
    "t1-untrained-n6": Setting(dict(temperature=1.0), "untrained", 6, n=2000),
    "t07-topp09-trained-n16": Setting(dict(temperature=0.7, top_p=0.9), "trained", 16, n=2000, min_deep_share=0.25),
    "topk3-trained-n6": Setting(dict(temperature=1.0, top_k=3), "trained", 6, min_deep_share=0.1),
    # FastGRPO's rule as rows finish: N = max(2, min(floor(C / B), 16)) grows from 2 to 16.
    "t1-trained-concurrency": Setting(dict(temperature=1.0), "trained", 16, capacity=9000, min_deep_share=0.01),
    "t07-topp09-trained-n16-gumbel": Setting(dict(temperature=0.7, top_p=0.9, sampler="gumbel"), "trained", 16, n=2000,
                                             min_deep_share=0.25),
}

# make test-fast's setting: trees that grow as rows finish, up to 16 nodes.
QUICK = {"t1-trained-concurrency"}


def fastgrpo_rollout(model, drafter, setting: Setting, rule=verify_tree, greedy: bool = False):
    """(output, recorder, sampling params) of one FastGRPO generate call with `rule` as the acceptance rule."""
    cfg = FastGRPOConfig(drafter_path=None, capacity=setting.capacity, max_nodes=setting.max_nodes)
    engine = RolloutEngine(model, decoder=FastGRPODecoder(model, cfg))
    engine.decoder.set_drafter(drafter)
    recorder = DecisionRecorder(engine, [len(p) for p in PROMPTS], setting.n, rule)
    sampling = dict(temperature=0.0) if greedy else setting.sampling
    params = SamplingParams(n=setting.n, max_new_tokens=NEW_TOKENS, seed=0, **sampling)
    return engine.generate(PROMPTS, params), recorder, params


@pytest.fixture(scope="module")
def rollouts(model, oracle, drafters):
    made = {}

    def get(name: str):
        if name not in made:
            setting = SETTINGS[name]
            out, recorder, params = fastgrpo_rollout(model, drafters[setting.drafter], setting)
            made[name] = out, decisions_of(oracle, PROMPTS, out, recorder, params, setting.n)
        return made[name]

    return get


@pytest.mark.parametrize("name", tiered(SETTINGS, QUICK))
def test_every_fastgrpo_token_follows_the_policy(rollouts, name, record_property):
    out, dec = rollouts(name)
    pvalues = exactness_pvalues(dec, MAX_DEPTH)
    by_depth = np.bincount(dec.depth, minlength=MAX_DEPTH + 1)
    record_property("pvalues", pvalues)
    print(f"{name}: {len(dec.tokens)} tokens, by decision depth {by_depth.tolist()}, "
          f"{out.stats.tree.tokens_per_step_mean:.2f} per verify step, Bonferroni min p {bonferroni_min(pvalues):.3g}")
    assert bonferroni_min(pvalues) > PASS_P, pvalues
    reference_lp = np.log(dec.probs[np.arange(len(dec.tokens)), dec.tokens])
    np.testing.assert_allclose(dec.logprobs, reference_lp, atol=1e-4)
    setting = SETTINGS[name]
    assert by_depth[2:].sum() >= setting.min_deep_share * len(dec.tokens), by_depth
    # Its passes count the tokens the responses kept (the first of each came from the prompt's pass).
    hist = out.stats.tree.tokens_per_step_hist
    assert sum(k * n for k, n in hist.items()) == sum(len(tokens) - 1 for tokens in out.token_ids)
    if setting.drafter == "untrained":
        tree = out.stats.tree
        assert tree.tokens_per_step_hist.get(1, 0) > 0.2 * tree.verify_steps  # rejections are exercised


@pytest.mark.parametrize("name", tiered(SETTINGS, QUICK))
def test_sampled_responses_are_the_plain_ones(model, rollouts, name):
    """As SpecRoll's: the same seed gives plain decoding's responses, token for token."""
    setting = SETTINGS[name]
    params = SamplingParams(n=setting.n, max_new_tokens=NEW_TOKENS, seed=0, **setting.sampling)
    assert_plain_responses(model, PROMPTS, rollouts(name)[0], params)


@pytest.mark.statistics
def test_pretraining_deepens_acceptance(rollouts):
    """The trained drafter is not the untrained one in disguise: more tokens per verify pass at the same tree size."""
    untrained, trained = rollouts("t1-untrained-n6")[0], rollouts("topk3-trained-n6")[0]
    assert trained.stats.tree.tokens_per_step_mean > untrained.stats.tree.tokens_per_step_mean + 0.3


def test_tree_rule_follows_concurrency(rollouts):
    """C = 9000 over 4500 rows: N starts at 2 and reaches N_max = 16 as rows finish."""
    budgets = rollouts("t1-trained-concurrency")[0].stats.tree.budget_per_step
    assert budgets[0] == 2 and max(budgets) == 16


@pytest.mark.parametrize("drafter", ["untrained", "trained"])
def test_greedy_equals_plain_decoding(model, drafters, drafter):
    setting = Setting({}, drafter, 16, n=3)
    out, recorder, params = fastgrpo_rollout(model, drafters[drafter], setting, greedy=True)
    plain = RolloutEngine(model).generate(PROMPTS, params)
    assert out.token_ids == plain.token_ids
    np.testing.assert_allclose(np.concatenate(out.logprobs), np.concatenate(plain.logprobs), atol=1e-5)
    assert out.stats.tree.tokens_per_step_mean > 1.0  # drafts were accepted, so the equality is not trivial


def leak_first_child(rate: float):
    """WRONG on purpose: at `rate` of the nodes with drafted children, accept the first child whatever
    the policy's sample there was."""
    generator = torch.Generator(torch.get_default_device()).manual_seed(1234)

    def rule(logprobs, tree: DraftTree, uniforms, params, max_depth) -> Verdict:
        chosen = torch.rand(logprobs.shape[:2], generator=generator, device=logprobs.device) < rate
        out = logprobs.clone()
        for i in range(tree.num_drafts + 1):
            children = (tree.parents == i) & tree.valid
            first = tree.tokens.gather(1, children.int().argmax(dim=1, keepdim=True))
            certain = torch.full_like(out[:, i], float("-inf")).scatter(1, first, 0.0)
            out[:, i] = torch.where((children.any(dim=1) & chosen[:, i])[:, None], certain, out[:, i])
        return verify_tree(out, tree, uniforms, params, max_depth)

    return rule


@pytest.mark.statistics
def test_a_biased_rule_fails_with_fastgrpo_trees(model, oracle, drafters):
    """Negative control: the tests have the power to catch a 2% leak with these trees."""
    setting = SETTINGS["t1-untrained-n6"]
    out, recorder, params = fastgrpo_rollout(model, drafters[setting.drafter], setting, rule=leak_first_child(0.02))
    pvalues = exactness_pvalues(decisions_of(oracle, PROMPTS, out, recorder, params, setting.n), MAX_DEPTH)
    assert bonferroni_min(pvalues) < FAIL_P, pvalues
