"""Statistical exactness of speculative rollouts (SPECROLL.md section 2).

On a tiny model with an 8-token vocabulary we enumerate every response of up to 3 tokens,
compute its exact probability by teacher forcing under the sampling settings, draw 20k
speculative samples and run a chi-square goodness-of-fit test. Trees hold the heads' drafts
and context lookup's (on by default; one case runs the heads alone). A deliberately biased
acceptance rule must fail the same test (negative control), so the test has power.
"""
from __future__ import annotations

import copy
import itertools

import pytest
import torch
from scipy.stats import chisquare

from specroll.models import build_tiny_model
from specroll.rollout import RolloutEngine, SamplingParams, sample_tokens, sampling_logprobs
from specroll.spec import HorizonHeads, SpecConfig
from specroll.spec.train_heads import HeadTrainConfig, SampleConfig, collect_samples, frequent_tokens, train_heads
from specroll.spec.verify import Verdict

VOCAB, EOS, NEW_TOKENS, SAMPLES = 8, 1, 3, 20_000
PROMPT = [3, 5, 2]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_tiny_model(vocab_size=VOCAB, eos_token_ids=[EOS], init_std=0.2, seed=3).requires_grad_(False)


def exact_distribution(model, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(response) for every response of up to NEW_TOKENS tokens (stopping at EOS), by teacher forcing."""
    seqs = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW_TOKENS)))
    ids = torch.cat((torch.tensor(PROMPT).expand(len(seqs), -1), seqs), dim=1)
    with torch.no_grad():
        logp = sampling_logprobs(model(ids).logits[:, len(PROMPT) - 1 : -1], params)
    prefix_logp = torch.gather(logp, 2, seqs[..., None]).squeeze(2).cumsum(1)
    probs: dict[tuple[int, ...], float] = {}
    for seq, lp in zip(seqs.tolist(), prefix_logp.exp().tolist()):
        stop = seq.index(EOS) + 1 if EOS in seq else NEW_TOKENS
        probs[tuple(seq[:stop])] = lp[stop - 1]
    assert abs(sum(probs.values()) - 1) < 1e-4
    return probs


def goodness_of_fit(samples: list[list[int]], probs: dict) -> float:
    counts = {seq: 0 for seq in probs}
    for s in samples:
        counts[tuple(s)] += 1
    n = len(samples)
    # Merge rare outcomes into one bin so every expected count is >= 5.
    big = [seq for seq, p in probs.items() if p * n >= 5]
    observed = [counts[s] for s in big]
    expected = [probs[s] * n for s in big]
    rest_observed, rest_expected = n - sum(observed), n - sum(expected)
    if rest_expected >= 5:
        observed.append(rest_observed)
        expected.append(rest_expected)
    else:  # too rare for a bin of its own: fold into the smallest bin
        smallest = min(range(len(expected)), key=expected.__getitem__)
        observed[smallest] += rest_observed
        expected[smallest] += rest_expected
    return chisquare(observed, expected).pvalue


def randomise_heads(heads, seed: int) -> None:
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def biased_verify(logprobs, tree, uniforms, greedy, max_depth) -> Verdict:
    """WRONG on purpose: accept the best child c with min(1, p(c)/q(c)), else resample from p.

    The correct residual would be norm(max(0, p - q)); sampling the bonus from p instead
    over-weights the drafted tokens. Used only as a negative control.
    """
    g = torch.Generator(torch.get_default_device()).manual_seed(1234)
    batch = logprobs.shape[0]
    samples, sample_lp = sample_tokens(logprobs, torch.rand(logprobs.shape[:2], generator=g, dtype=torch.float64), False)
    rows = torch.arange(batch)
    current = torch.zeros(batch, dtype=torch.long)
    alive = torch.ones(batch, dtype=torch.bool)
    path, accepted = [current], []
    for _ in range(max_depth):
        is_child = (tree.parents == current[:, None]) & tree.valid & alive[:, None]
        has_child = is_child.any(1)
        first = is_child.int().argmax(1)
        child_tok = tree.tokens[rows, first]
        p = logprobs[rows, current, child_tok].exp()
        q = tree.head_probs[rows, first].float()
        take = has_child & (torch.rand(batch, generator=g) < (p / q).clamp(max=1))
        accepted.append(take)
        current = torch.where(take, first + 1, current)
        alive &= take
        path.append(current)
    path_t = torch.stack(path, 1)
    acc = torch.stack(accepted, 1)
    counts = acc.sum(1) + 1
    node_tokens = torch.cat((samples[:, :1], tree.tokens), 1)  # token of each combined node
    emitted = torch.gather(node_tokens, 1, path_t[:, 1:])  # accepted drafts ...
    bonus = torch.gather(samples, 1, torch.gather(path_t, 1, (counts - 1)[:, None]))
    emitted = torch.cat((emitted, bonus), 1).scatter(1, (counts - 1)[:, None], bonus)  # ... then the bonus
    lp = logprobs[rows[:, None], path_t, emitted]
    return Verdict(path_t, counts, emitted, lp, acc, torch.zeros(batch, max_depth))


@pytest.fixture(scope="module")
def heads(model, tmp_path_factory):
    """Untrained random heads (many rejections) and heads distilled from the policy (long acceptances)."""
    random_heads = {t: HorizonHeads.for_model(model, t, 4) for t in ("path", "medusa")}
    for h in random_heads.values():
        randomise_heads(h, seed=7)
    trained = HorizonHeads.for_model(model, "path", 4)
    prompts = [PROMPT, [2, 6], [4, 4, 7, 3]]
    samples = collect_samples(model, prompts, SampleConfig(positions=3000, prompts_per_batch=3, samples_per_prompt=64,
                                                            max_new_tokens=8), tmp_path_factory.mktemp("s"), progress=False)
    train_heads(model, trained, samples.sequences, HeadTrainConfig(epochs=3, lr=3e-3, batch_positions=256),
                progress=False, log=lambda _: None)
    # The same heads drafting among the 5 most frequent of the 8 tokens only.
    narrow = copy.deepcopy(trained)
    narrow.set_draft_vocab(frequent_tokens(samples.sequences, 5))
    return {"path-random": random_heads["path"], "medusa-random": random_heads["medusa"], "path-trained": trained,
            "path-trained-vocab5": narrow}


def spec_samples(model, heads, params, nodes=4, seed=0, verify=None, lookup="learned"):
    """lookup: "learned" (the default estimates, which soon leave out the rarely accepted
    chains of this random model), "first" (chains always ranked first) or "off"."""
    cfg = SpecConfig(head_type=heads.head_type, heads_path=None, budget="fixed", fixed_nodes=nodes, max_nodes=nodes,
                     context_lookup=lookup != "off")
    engine = RolloutEngine(model, spec=cfg)
    engine.decoder.set_heads(heads)
    if lookup == "first":
        engine.decoder.lookup_acceptance.rate.fill_(1.0)
        engine.decoder.lookup_acceptance.momentum = 1.0  # never learns otherwise
    if verify is not None:
        engine.decoder.verify = verify
    return engine.generate([PROMPT], SamplingParams(n=SAMPLES, max_new_tokens=NEW_TOKENS, seed=seed, **params))


SETTINGS = {
    "t1": dict(temperature=1.0),
    "t07_top_p09": dict(temperature=0.7, top_p=0.9),
    "top_k5": dict(temperature=1.0, top_k=5),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("drafter", ["path-random", "medusa-random", "path-trained", "path-trained-vocab5",
                                     "path-random+lookup-first"])
def test_speculative_samples_follow_the_policy(model, heads, setting, drafter):
    params = SETTINGS[setting]
    probs = exact_distribution(model, SamplingParams(**params))
    trained = drafter.startswith("path-trained")
    heads_name, _, lookup = drafter.partition("+lookup-")
    out = spec_samples(model, heads[heads_name], params, nodes=8 if trained else 4, lookup=lookup or "learned")
    hist = out.stats["tokens_per_step_hist"]
    if trained:
        # Trained heads reach depth 2 and beyond often: long acceptances are exercised.
        assert sum(v for k, v in hist.items() if k >= 3) > 0.2 * sum(hist.values()), hist
    else:
        assert hist.get(1, 0) > 0.1 * sum(hist.values()), hist  # rejections are exercised
    if lookup == "first":  # trees hold context lookup chains, and some of their drafts are accepted
        assert out.stats["lookup_token_share"] > 0.1
    assert goodness_of_fit(out.token_ids, probs) > 1e-3


def test_heads_only_samples_follow_the_policy(model, heads):
    """The same with context lookup off: trees from the heads alone."""
    params = SETTINGS["t07_top_p09"]
    out = spec_samples(model, heads["path-trained"], params, nodes=8, lookup="off")
    assert out.stats["lookup_token_share"] == 0 and out.stats["tokens_per_step_mean"] > 1.3
    assert goodness_of_fit(out.token_ids, probs=exact_distribution(model, SamplingParams(**params))) > 1e-3


def test_plain_sampling_follows_the_policy(model):
    params = SETTINGS["t07_top_p09"]
    probs = exact_distribution(model, SamplingParams(**params))
    out = RolloutEngine(model).generate([PROMPT], SamplingParams(n=SAMPLES, max_new_tokens=NEW_TOKENS, seed=1, **params))
    assert goodness_of_fit(out.token_ids, probs) > 1e-3


def test_biased_acceptance_rule_is_rejected(model, heads):
    """Negative control: the same test catches a rule that is known to bias the output."""
    params = SETTINGS["t1"]
    probs = exact_distribution(model, SamplingParams(**params))
    out = spec_samples(model, heads["path-trained"], params, verify=biased_verify)
    assert out.stats["tokens_per_step_mean"] > 1.05  # drafts were accepted, so the bias had a chance
    assert goodness_of_fit(out.token_ids, probs) < 1e-6
