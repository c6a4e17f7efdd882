"""Statistical exactness of speculative rollouts, every token at every tree depth (docs/algorithm.md, section 2).

A tiny model (a Llama, and a Qwen3 with its query/key norms) with an 8-token vocabulary generates
thousands of 24-token responses to three prompts of different lengths in one batch, with trees
deep enough that many verify steps accept 2, 3 and 4 drafts. Every kept token is tested against
its exact conditional given its true prefix, computed apart from the code under test
(transformers' forward of the same weights, a hand-written sampling filter): see `exactness.py`
for the statistics. Test-only acceptance rules with subtle biases (negative controls) must fail the same tests.
"""
from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field, replace

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

from specroll.models import build_tiny_model
from specroll.rollout import RolloutEngine, SamplingParams, sample_tokens, samplers, sampling
from specroll.speculation import HorizonHeads, SpeculationConfig, SpeculativeDecoder, step
from specroll.speculation.adaptation.consolidation import ConsolidationConfig, HeadConsolidator
from specroll.speculation.adaptation.drift_detector import DriftConfig
from specroll.speculation.adaptation.reflex import ReflexConfig
from specroll.speculation.budgets import tree_gate
from specroll.speculation.drafting.tree import DraftTree
from specroll.speculation.head_training.samples import SampleConfig, collect_samples, frequent_tokens
from specroll.speculation.head_training.training import HeadTrainConfig, train_heads
from specroll.speculation.verification.verify import Verdict, verify_tree

VOCAB, EOS, NUM_HEADS, NEW_TOKENS = 8, 1, 4, 24
PROMPTS = [[3, 5, 2], [2, 6], [4, 4, 7, 3, 0, 5]]
# The real rule must pass every setting; a biased rule must fail (both after Bonferroni over the tests).
PASS_P, FAIL_P = 1e-4, 1e-6


# The architectures the tests run on (Qwen3: query/key norms, heads wider than hidden / heads), and
# each setting's `min_deep_share` times this: the tiny Qwen3's trained heads reach depths 2-4 less
# often than the Llama's (22% of its tokens at T=0.7 with 16 nodes, 3% as rows finish).
DEEP_SHARE_SCALE = {"llama": 1.0, "qwen3": 0.4}


@pytest.fixture(scope="module", params=sorted(DEEP_SHARE_SCALE))
def model(request):
    return build_tiny_model(request.param, vocab_size=VOCAB, eos_token_ids=[EOS], init_std=0.2, seed=3).requires_grad_(False)


@pytest.fixture(autouse=True)
def statistics_tier_on_the_llama_alone(request):
    """Qwen3 runs every tier's quick settings; the minutes of the statistics tier and the negative
    controls (the tests' power, whatever the architecture) run on the Llama once."""
    callspec = getattr(request.node, "callspec", None)
    if callspec and callspec.params.get("model") != "llama" and (
            request.node.get_closest_marker("statistics") or "mutation" in callspec.params):
        pytest.skip("the statistics tier and the negative controls run on the Llama; this architecture runs the quick settings")


@pytest.fixture(scope="module")
def oracle(model):
    return hf_oracle(model)


def randomise_heads(heads: HorizonHeads, seed: int) -> HorizonHeads:
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return heads


@pytest.fixture(scope="module")
def heads(model, tmp_path_factory):
    """Untrained random heads (many rejections) and heads distilled from the policy (deep acceptances)."""
    samples = collect_samples(model, PROMPTS, SampleConfig(positions=3000, prompts_per_batch=3, samples_per_prompt=64,
                                                           max_new_tokens=8), tmp_path_factory.mktemp("s"), progress=False)
    out = {f"{t}-random": randomise_heads(HorizonHeads.for_model(model, t, NUM_HEADS), seed=7) for t in ("path", "medusa")}
    for head_type in ("path", "medusa"):
        trained = HorizonHeads.for_model(model, head_type, NUM_HEADS)
        train_heads(model, trained, samples.sequences, HeadTrainConfig(epochs=3, lr=3e-3, batch_positions=256),
                    progress=False, log=lambda _: None)
        out[f"{head_type}-trained"] = trained
    # The same heads drafting among the 5 most frequent of the 8 tokens only.
    out["path-trained-vocab5"] = copy.deepcopy(out["path-trained"])
    out["path-trained-vocab5"].set_draft_vocab(frequent_tokens(samples.sequences, 5))
    return out


@dataclass(frozen=True)
class Setting:
    sampling: dict  # SamplingParams fields
    heads: str  # key of the `heads` fixture
    spec: dict = field(default_factory=dict)  # SpeculationConfig fields besides the heads
    lookup: str = "learned"  # context lookup: "learned" estimates, chains ranked "first", or "off"
    n: int = 1500  # responses per prompt
    min_deep_share: float = 0.0  # kept tokens from decisions at depth >= 2 must be at least this share
    nucleus_candidates: int | None = None  # top-p searched among this many tokens first (else rows are sorted whole)
    gate_probe_every: int | None = None  # a closed tree gate probing every this many plain steps (see gated_profile)
    history_calls: int = 0  # earlier generate calls (other seeds) whose responses history lookup keeps
    gumbel_candidates: int | None = None  # the gumbel sampler's candidates (else GUMBEL_CANDIDATES, all of VOCAB)


SETTINGS = {
    "t07-topp09-path-trained-fixed16": Setting(dict(temperature=0.7, top_p=0.9), "path-trained",
                                               dict(budget="fixed", fixed_nodes=16), n=2000, min_deep_share=0.25),
    # Rows finish at EOS, so the budget grows from 4 nodes to 16 as concurrency falls (as read
    # every sync_every steps: sync-free trees lag the finished rows by up to that many steps).
    "t1-path-trained-concurrency": Setting(dict(temperature=1.0), "path-trained",
                                           dict(budget="concurrency", capacity=18000, sync_free_trees=True),
                                           min_deep_share=0.05),
    # Reflex here judges drafts against the target restricted to the heads' 5-token draft vocabulary.
    "topk3-vocab5-lookup-first-cost-model": Setting(dict(temperature=1.0, top_k=3), "path-trained-vocab5",
                                                    dict(budget="cost_model", min_gain=0.0, adaptation="reflex",
                                                         reflex=ReflexConfig(mode="paper", scale=100.0,
                                                                             reliability_threshold=-1.0)),
                                                    lookup="first", n=600,
                                                    # Its trees follow measured timings, so machine load moves this share (2-5%).
                                                    min_deep_share=0.01),
    # Top-p among 3 candidates, rows sorted whole only where those may not hold the nucleus; the
    # plain responses it is compared with sort every row.
    "t07-topp09-path-trained-fixed8-candidates3": Setting(dict(temperature=0.7, top_p=0.9), "path-trained",
                                                          dict(budget="fixed", fixed_nodes=8), n=1000,
                                                          min_deep_share=0.1, nucleus_candidates=3),
    "t12-topp095-medusa-trained-fixed8": Setting(dict(temperature=1.2, top_p=0.95), "medusa-trained",
                                                 dict(budget="fixed", fixed_nodes=8, sync_free_trees=True),
                                                 min_deep_share=0.05),
    # The tree gate closed from the start and probing every 3 plain steps: plain steps and trees
    # alternate in sync-free batches.
    "t1-path-random-concurrency-gated": Setting(dict(temperature=1.0), "path-random",
                                                dict(budget="concurrency", sync_free_trees=True), gate_probe_every=3),
    # Plain decoding throughout (capacity 1) that scores a would-be tree at every step it can:
    # drafting and scoring beside plain sampling leave every token as it was.
    "t1-path-trained-plain-would-be": Setting(dict(temperature=1.0), "path-trained",
                                              dict(budget="concurrency", capacity=1, fixed_nodes=8, would_be_every=1)),
    "t1-path-random-fixed4": Setting(dict(temperature=1.0), "path-random", dict(budget="fixed", fixed_nodes=4), n=3000),
    # Group siblings' text and an earlier call's responses drafted beside random heads and context lookup.
    "t1-path-random-fixed8-siblings-history": Setting(dict(temperature=1.0), "path-random",
                                                      dict(budget="fixed", fixed_nodes=8, sibling_lookup=True,
                                                           history_lookup=True), n=1000, history_calls=1,
                                                      min_deep_share=0.05),
    # Sibling and history chains alone (no head drafts, no context lookup), at every depth.
    "t07-topp09-lookups-only-fixed16-siblings-history": Setting(dict(temperature=0.7, top_p=0.9), "path-trained",
                                                                dict(budget="fixed", fixed_nodes=16, head_drafts=False,
                                                                     sibling_lookup=True, history_lookup=True),
                                                                lookup="off", n=1000, history_calls=1, min_deep_share=0.2),
    "t07-medusa-random-lookup-first-fixed8": Setting(dict(temperature=0.7), "medusa-random",
                                                     dict(budget="fixed", fixed_nodes=8), lookup="first",
                                                     min_deep_share=0.03),
    # Reflex, strong enough to change drafts: the code's rule at 300x its scale, and the paper's
    # rule (coverage term) with the reliability gate always open.
    "t07-topp09-path-trained-fixed16-reflex": Setting(
        dict(temperature=0.7, top_p=0.9), "path-trained",
        dict(budget="fixed", fixed_nodes=16, adaptation="reflex", reflex=ReflexConfig(mode="code", scale=300.0)),
        n=2000, min_deep_share=0.2),
    "t1-medusa-trained-fixed8-reflex-paper": Setting(
        dict(temperature=1.0), "medusa-trained",
        dict(budget="fixed", fixed_nodes=8, adaptation="reflex",
             reflex=ReflexConfig(mode="paper", scale=100.0, reliability_threshold=-1.0)), min_deep_share=0.03),
    # The gumbel sampler among 3 of the 8 tokens, so both its stages draw; then among all 8. Blind
    # trees, whose acceptance null these tests know (trees that read the draws: test_speculation_reading_exactness.py).
    "t1-path-trained-fixed8-gumbel-candidates3": Setting(dict(temperature=1.0, sampler="gumbel"), "path-trained",
                                                         dict(budget="fixed", fixed_nodes=8, read_draws=False),
                                                         gumbel_candidates=3, min_deep_share=0.05),
    "t07-topp09-path-trained-fixed16-gumbel": Setting(dict(temperature=0.7, top_p=0.9, sampler="gumbel"), "path-trained",
                                                      dict(budget="fixed", fixed_nodes=16, read_draws=False), n=2000,
                                                      min_deep_share=0.25),
    "t1-path-trained-concurrency-gumbel": Setting(dict(temperature=1.0, sampler="gumbel"), "path-trained",
                                                  dict(budget="concurrency", capacity=18000, sync_free_trees=True,
                                                       read_draws=False), min_deep_share=0.05),
}


# make test-fast's settings: deep trees under top-p, many rejections, a budget that grows as rows finish.
QUICK = {"t07-topp09-path-trained-fixed16", "t1-path-random-fixed4", "t1-path-trained-concurrency",
         "t1-path-trained-fixed8-gumbel-candidates3"}
QUICK_MUTATIONS = {"leak-2%", "parent-uniform-below-depth-1", "child-reuses-parent-noise-gumbel"}


def cost_model_profile(decoder) -> None:
    """Verify cost grows with the pass's total tokens, so larger trees pay as rows finish; passes
    of seconds make the measured drafting time (milliseconds here) too small to sway the plan."""
    prof = decoder.profile
    prof.batch_sizes, prof.nodes = [1, 64, 512, 4096], [1, 2, 4, 8, 16]
    prof.latency_s = [[1 + b * n / 4000 for n in prof.nodes] for b in prof.batch_sizes]


def gated_profile(decoder) -> None:
    """Trees cost twice a plain step at every batch size and are expected to emit a token per row:
    the gate stays closed but for its probes; the capacity gives every row 4 nodes."""
    prof = decoder.profile
    prof.batch_sizes, prof.nodes = [1, 64, 512, 4096, 8192], [1, 2, 4, 8, 16]
    prof.latency_s = [[1.0 if n == 1 else 2.0 for n in prof.nodes] for _ in prof.batch_sizes]
    decoder.capacity = 18000
    decoder.gate.tokens, decoder.gate.rows = [1.0] * len(decoder.gate.buckets), [1.0] * len(decoder.gate.buckets)


@contextlib.contextmanager
def sampler_candidates(setting: Setting):
    """The gumbel sampler's candidates as `setting` asks, for its plain and speculative calls alike."""
    with pytest.MonkeyPatch.context() as patch:
        if setting.gumbel_candidates is not None:
            patch.setattr(samplers, "GUMBEL_CANDIDATES", setting.gumbel_candidates)
        yield


def speculative_rollout(model, heads, setting: Setting, rule=verify_tree, noise=None):
    """(output, recorder, sampling params) of one speculative generate call with `rule` as the acceptance
    rule; `noise` (a `NOISE_MUTATIONS` entry) rekeys the draws it samples with."""
    nodes = setting.spec.get("fixed_nodes", 16)
    cfg = SpeculationConfig(head_type=heads.head_type, num_heads=NUM_HEADS, heads_path=None, max_nodes=nodes,
                     context_lookup=setting.lookup != "off", **setting.spec)
    engine = RolloutEngine(model, decoder=SpeculativeDecoder(model, cfg))
    engine.decoder.set_heads(heads)
    if cfg.budget == "cost_model":
        cost_model_profile(engine.decoder)
    if setting.gate_probe_every is not None:
        gated_profile(engine.decoder)
    if setting.lookup == "first":  # chains ranked first and never re-estimated
        engine.decoder.estimates.lookup_acceptance.rate.fill_(1.0)
        engine.decoder.estimates.lookup_acceptance.momentum = 1.0
    params = SamplingParams(n=setting.n, max_new_tokens=NEW_TOKENS, seed=0, **setting.sampling)
    for call in range(setting.history_calls):
        earlier = engine.generate(PROMPTS, replace(params, seed=100 + call))
        engine.decoder.learn_from_responses(PROMPTS, earlier.token_ids, setting.n)
    recorder = DecisionRecorder(engine, [len(p) for p in PROMPTS], setting.n, rule)
    with pytest.MonkeyPatch.context() as patch, sampler_candidates(setting):
        if noise is not None:
            noise(patch)
        if setting.nucleus_candidates is not None:
            patch.setattr(sampling, "NUCLEUS_CANDIDATES", setting.nucleus_candidates)
        if setting.gate_probe_every is not None:
            patch.setattr(tree_gate, "PROBE_EVERY", setting.gate_probe_every)
            patch.setattr(tree_gate, "MAX_PROBE_EVERY", setting.gate_probe_every)
        return engine.generate(PROMPTS, params), recorder, params


@pytest.fixture(scope="module", autouse=True)
def profile_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECROLL_CACHE", str(tmp_path_factory.mktemp("cache")))  # the cost-model engine measures a profile
        yield


@pytest.fixture(scope="module")
def rollouts(model, oracle, heads):
    """Each setting's rollout and decisions with the real acceptance rule, made once per module."""
    made = {}

    def get(name: str):
        if name not in made:
            setting = SETTINGS[name]
            out, recorder, params = speculative_rollout(model, heads[setting.heads], setting)
            made[name] = out, decisions_of(oracle, PROMPTS, out, recorder, params, setting.n)
        return made[name]

    return get


@pytest.mark.parametrize("name", tiered(SETTINGS, QUICK))
def test_every_speculative_token_follows_the_policy(model, rollouts, name, record_property):
    out, dec = rollouts(name)
    pvalues = exactness_pvalues(dec, NUM_HEADS)
    by_depth = np.bincount(dec.depth, minlength=NUM_HEADS + 1)
    record_property("tokens_by_depth", by_depth.tolist())
    record_property("pvalues", pvalues)
    print(f"{name}: {len(dec.tokens)} tokens, by decision depth {by_depth.tolist()}, "
          f"{out.stats.tree.tokens_per_step_mean:.2f} per verify step, Bonferroni min p {bonferroni_min(pvalues):.3g}")
    assert bonferroni_min(pvalues) > PASS_P, pvalues
    # The log-probs a rollout reports are those of the distribution each token was drawn from.
    reference_lp = np.log(dec.probs[np.arange(len(dec.tokens)), dec.tokens])
    np.testing.assert_allclose(dec.logprobs, reference_lp, atol=1e-4)
    setting = SETTINGS[name]
    # Deep paths are exercised where the heads are good: decisions at depth 2-4 emitted a large share.
    min_deep_share = setting.min_deep_share * DEEP_SHARE_SCALE[model.config.model_type]
    assert by_depth[2:].sum() >= min_deep_share * len(dec.tokens), by_depth
    if setting.heads.endswith("random"):
        tree = out.stats.tree
        assert tree.tokens_per_step_hist.get(1, 0) > 0.3 * tree.verify_steps  # rejections are exercised
    if setting.lookup == "first":  # trees hold context lookup chains, and some of their drafts are accepted
        assert out.stats.tree.lookup_token_share > 0.1
    if setting.spec.get("would_be_every"):  # plain throughout, would-be trees scored
        assert set(out.stats.tree.budget_per_step) == {1} and out.stats.tree.would_be_tokens_per_step > 1.2
    if setting.gate_probe_every is not None:  # plain steps and trees alternated
        assert 1 in out.stats.tree.budget_per_step and max(out.stats.tree.budget_per_step) > 1


@pytest.mark.parametrize("name", tiered(SETTINGS, QUICK))
def test_sampled_responses_are_the_plain_ones(model, rollouts, name):
    """Whatever was drafted, a speculative response is the plain one for the same seed."""
    setting = SETTINGS[name]
    params = SamplingParams(n=setting.n, max_new_tokens=NEW_TOKENS, seed=0, **setting.sampling)
    out = rollouts(name)[0]
    with sampler_candidates(setting):
        assert_plain_responses(model, PROMPTS, out, params)


@pytest.mark.statistics
def test_reflex_changed_the_drafts(rollouts):
    """The Reflex settings are not the static ones in disguise: the correction moved what was drafted."""
    static, reflex = rollouts("t07-topp09-path-trained-fixed16")[0], rollouts("t07-topp09-path-trained-fixed16-reflex")[0]
    assert reflex.stats.tree.reflex.on_share > 0.5
    assert reflex.stats.tree.tokens_per_step_hist != static.stats.tree.tokens_per_step_hist
    assert rollouts("t1-medusa-trained-fixed8-reflex-paper")[0].stats.tree.reflex.on_share > 0.5
    vocab5 = rollouts("topk3-vocab5-lookup-first-cost-model")[0].stats.tree.reflex  # heads with a draft vocabulary
    assert vocab5.records > 0 and math.isfinite(vocab5.state_rms)


@pytest.mark.statistics
def test_tokens_follow_the_policy_across_a_head_update(model, oracle, heads):
    """adaptation=both (Reflex on, records collected) with a head-only update published between
    two generate calls, as a rollout actor sees it between training steps."""
    setting = Setting(dict(temperature=1.0), "path-random",
                      dict(budget="fixed", fixed_nodes=8, adaptation="both", reflex=ReflexConfig(mode="code", scale=300.0)))
    first, recorder, params = speculative_rollout(model, heads[setting.heads], setting)
    before = decisions_of(oracle, PROMPTS, first, recorder, params, setting.n)
    consolidator = HeadConsolidator(heads[setting.heads], "every_step", DriftConfig(), ConsolidationConfig(lr=3e-3, steps=20))
    asked = consolidator.observe(*recorder.decoder.pop_head_records(), policy_version=0)
    update = consolidator.update(asked, model.lm_head.weight, model.embed_tokens.weight)
    assert update.committed and consolidator.version == 1
    recorder.decoder.set_heads(copy.deepcopy(consolidator.heads))
    recorder.steps.clear()
    params = replace(params, seed=1)
    second = recorder.engine.generate(PROMPTS, params)
    after = decisions_of(oracle, PROMPTS, second, recorder, params, setting.n)
    assert second.stats.tree.tokens_per_step_mean > first.stats.tree.tokens_per_step_mean  # the update drafts better
    for dec in (before, after):
        assert bonferroni_min(exactness_pvalues(dec, NUM_HEADS)) > PASS_P


def test_eos_inside_deep_accepted_paths(rollouts):
    """Under top-p, responses end at EOS emitted deep inside accepted paths, and are cut there."""
    out, dec = rollouts("t07-topp09-path-trained-fixed16")
    assert ((dec.tokens == EOS) & (dec.depth >= 2)).sum() > 100
    assert all(EOS not in t[:-1] for t in out.token_ids)


def test_concurrency_budget_grows_as_rows_finish(rollouts):
    budgets = rollouts("t1-path-trained-concurrency")[0].stats.tree.budget_per_step
    assert budgets[0] == 4 and max(budgets) == 16


@pytest.mark.statistics
def test_cost_model_trees_vary_with_concurrency(rollouts):
    out, _ = rollouts("topk3-vocab5-lookup-first-cost-model")
    assert len(set(out.stats.tree.budget_per_step)) >= 3, out.stats.tree.budget_per_step


def test_plain_sampling_follows_the_policy(model, oracle):
    """The same tests pass for plain decoding (every decision at depth 0, nothing drafted)."""
    n = 1500
    params = SamplingParams(n=n, max_new_tokens=NEW_TOKENS, seed=1, temperature=0.7, top_p=0.9)
    out = RolloutEngine(model).generate(PROMPTS, params)
    dec = decisions_of(oracle, PROMPTS, out, None, params, n)
    assert bonferroni_min(exactness_pvalues(dec, NUM_HEADS)) > PASS_P


def point_mass_on_first_child(logprobs: torch.Tensor, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
    """`logprobs` [B, 1+M, V] with the distribution at each chosen node ([B, 1+M] bool) that has
    drafted children replaced by certainty of its first child: the verifier then accepts it."""
    out = logprobs.clone()
    for i in range(tree.num_drafts + 1):
        children = (tree.parents == i) & tree.valid
        first = tree.tokens.gather(1, children.int().argmax(dim=1, keepdim=True))
        certain = torch.full_like(out[:, i], float("-inf")).scatter(1, first, 0.0)
        out[:, i] = torch.where((children.any(dim=1) & nodes[:, i])[:, None], certain, out[:, i])
    return out


def leaky(rate: float):
    """WRONG on purpose: at `rate` of the nodes with drafted children, accept the first child
    whatever the policy's sample there was."""
    generator = torch.Generator(torch.get_default_device()).manual_seed(1234)

    def rule(logprobs, tree, uniforms, params, max_depth) -> Verdict:
        nodes = torch.rand(logprobs.shape[:2], generator=generator, device=logprobs.device) < rate
        return verify_tree(point_mass_on_first_child(logprobs, tree, nodes), tree, uniforms, params, max_depth)

    return rule


def first_child_from_third_decision(logprobs, tree, uniforms, params, max_depth) -> Verdict:
    """WRONG on purpose: from the third decision of a step on (nodes at depth >= 2), always accept the first child."""
    depth = torch.cat((torch.zeros_like(tree.depths[:, :1]), tree.depths), dim=1)
    return verify_tree(point_mass_on_first_child(logprobs, tree, depth >= 2), tree, uniforms, params, max_depth)


def parent_uniform_from_depth(depth: int):
    """WRONG on purpose: nodes at `depth` and below reuse their parent's draw (its uniform, and under
    the gumbel sampler its noise) instead of a fresh one."""

    def rule(logprobs, tree, uniforms, params, max_depth) -> Verdict:
        reused = uniforms.clone()
        for i in range(tree.num_drafts):  # parents come before their children
            parent = reused.gather(1, tree.parents[:, i : i + 1])[:, 0]
            reused[:, i + 1] = torch.where(tree.depths[:, i] >= depth, parent, reused[:, i + 1])
        return verify_tree(logprobs, tree, reused, params, max_depth)

    return rule


def ratio_acceptance(logprobs, tree, uniforms, params, max_depth) -> Verdict:
    """WRONG on purpose: accept the first child c with min(1, p(c)/q(c)) using the head's q,
    else emit the policy's sample at that node (the exact residual would be norm(max(0, p - q)))."""
    samples, _ = sample_tokens(logprobs, uniforms, params)  # [B, 1+M]
    generator = torch.Generator(logprobs.device).manual_seed(99)
    batch = logprobs.shape[0]
    rows = torch.arange(batch, device=logprobs.device)
    current = torch.zeros(batch, dtype=torch.long, device=logprobs.device)
    alive = torch.ones(batch, dtype=torch.bool, device=logprobs.device)
    path, accepted = [current], []
    for _ in range(max_depth if tree.num_drafts else 0):
        children = (tree.parents == current[:, None]) & tree.valid & alive[:, None]
        first = children.int().argmax(dim=1)
        ratio = logprobs[rows, current, tree.tokens[rows, first]].exp() / tree.head_probs[rows, first]
        take = children.any(dim=1) & (torch.rand(batch, generator=generator, device=ratio.device) < ratio.clamp(max=1))
        accepted.append(take)
        current = torch.where(take, first + 1, current)
        alive &= take
        path.append(current)
    path_t = torch.stack(path, dim=1)
    accepted_t = torch.stack(accepted, dim=1) if accepted else torch.zeros(batch, 0, dtype=torch.bool)
    counts = accepted_t.sum(dim=1) + 1
    node_tokens = torch.cat((samples[:, :1], tree.tokens), dim=1)  # the token each draft node holds
    bonus = samples.gather(1, path_t.gather(1, (counts - 1)[:, None]))
    tokens = torch.cat((node_tokens.gather(1, path_t[:, 1:]), bonus), dim=1).scatter(1, (counts - 1)[:, None], bonus)
    token_lp = logprobs[rows[:, None], path_t, tokens]  # token j was decided at node path[j]
    return Verdict(path_t, counts, tokens, token_lp, accepted_t, torch.zeros(batch, accepted_t.shape[1]))


MUTATIONS = {  # rule, the setting it is tried on
    "leak-1%": (leaky(0.01), "t1-path-random-fixed4"),
    "leak-2%": (leaky(0.02), "t1-path-random-fixed4"),
    "first-child-from-third-decision": (first_child_from_third_decision, "t07-topp09-path-trained-fixed16"),
    "parent-uniform-below-depth-1": (parent_uniform_from_depth(2), "t07-topp09-path-trained-fixed16"),
    "child-reuses-parent-noise-gumbel": (parent_uniform_from_depth(1), "t1-path-trained-fixed8-gumbel-candidates3"),
    "ratio-acceptance": (ratio_acceptance, "t1-path-trained-concurrency"),
    "leak-5%-siblings-history": (leaky(0.05), "t1-path-random-fixed8-siblings-history"),  # n=1000 finds a 2% leak, not below FAIL_P
    "first-child-from-third-decision-lookups-only": (first_child_from_third_decision,
                                                     "t07-topp09-lookups-only-fixed16-siblings-history"),
}


@pytest.mark.parametrize("mutation", tiered(MUTATIONS, QUICK_MUTATIONS))
def test_biased_acceptance_rules_are_rejected(model, oracle, heads, mutation, record_property):
    """Negative controls: subtle biases in the acceptance rule fail the same tests."""
    rule, name = MUTATIONS[mutation]
    assert_rejected(model, oracle, heads, mutation, name, record_property, rule=rule)


def assert_rejected(model, oracle, heads, mutation: str, name: str, record_property, **wrong) -> None:
    """Setting `name` run with the `wrong` rule or noise fails the exactness tests."""
    setting = SETTINGS[name]
    out, recorder, params = speculative_rollout(model, heads[setting.heads], setting, **wrong)
    pvalues = exactness_pvalues(decisions_of(oracle, PROMPTS, out, recorder, params, setting.n), NUM_HEADS)
    record_property("pvalues", pvalues)
    print(f"{mutation} on {name}: Bonferroni min p {bonferroni_min(pvalues):.3g}")
    assert bonferroni_min(pvalues) < FAIL_P, pvalues


def rekeyed_draws(draws_of, plain_steps: bool):
    """WRONG on purpose: tree nodes (and with `plain_steps` plain steps too) sample with the draws
    `draws_of(draws)` of their rows' streams instead of `draws` (each node's response position)."""
    real = sampling.uniforms_at

    def patch_in(patch: pytest.MonkeyPatch) -> None:
        def fake(keys, draws):
            return real(keys, draws_of(draws))

        patch.setattr(step, "uniforms_at", fake)
        if plain_steps:
            patch.setattr(sampling, "uniforms_at", fake)

    return patch_in


NOISE_MUTATIONS = {  # how the draws are rekeyed, the setting it is tried on
    # Every token of a response with the same draw: noise keyed by the seed and the row alone.
    "noise-not-keyed-by-position": (rekeyed_draws(torch.zeros_like, plain_steps=True),
                                    "t1-path-trained-fixed8-gumbel-candidates3"),
    # Node i of a tree with the draw i places ahead, whatever its depth: the next pass reuses draws.
    "noise-keyed-by-tree-node": (rekeyed_draws(lambda d: d[:, :1] + torch.arange(d.shape[1], device=d.device),
                                               plain_steps=False), "t1-path-trained-concurrency-gumbel"),
}
QUICK_NOISE_MUTATIONS: set[str] = set()  # the quick tier has a child reusing its parent's noise


@pytest.mark.parametrize("mutation", tiered(NOISE_MUTATIONS, QUICK_NOISE_MUTATIONS))
def test_miskeyed_noise_is_rejected(model, oracle, heads, mutation, record_property):
    """Negative controls: draws not keyed by the response position fail the same tests."""
    noise, name = NOISE_MUTATIONS[mutation]
    assert_rejected(model, oracle, heads, mutation, name, record_property, noise=noise)
