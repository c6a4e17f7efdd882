"""The slow path's head-only update (speculation/adaptation/consolidation.py) on a tiny policy that drifted away
from the policy its heads were trained for."""
from __future__ import annotations

import copy

import pytest
import torch

from specroll.models import build_tiny_model
from specroll.rollout import RolloutEngine, SamplingParams
from specroll.speculation import HorizonHeads, SpeculationConfig, SpeculativeDecoder
from specroll.speculation.adaptation.consolidation import (
    ConsolidationConfig,
    HeadConsolidator,
    held_out_fit,
    records_batch,
)
from specroll.speculation.adaptation.drift_detector import DriftConfig
from specroll.speculation.head_training.samples import SampleConfig, collect_samples
from specroll.speculation.head_training.training import HeadTrainConfig, train_heads

PROMPTS = [[3, 4, 5], [6, 7], [9, 1, 2, 8], [10, 11]]


@pytest.fixture(scope="module")
def drift(tmp_path_factory):
    """(policy B, heads trained for policy A): B is A with its last layer and LM head perturbed."""
    policy_a = build_tiny_model(vocab_size=64, init_std=0.15, seed=3).requires_grad_(False)
    heads = HorizonHeads.for_model(policy_a, "path", 4)
    samples = collect_samples(policy_a, PROMPTS, SampleConfig(positions=4000, prompts_per_batch=4, samples_per_prompt=32,
                                                              max_new_tokens=24), tmp_path_factory.mktemp("s"),
                              progress=False)
    train_heads(policy_a, heads, samples.sequences, HeadTrainConfig(epochs=3, lr=3e-3, batch_positions=256),
                progress=False, log=lambda _: None)
    policy_b = build_tiny_model(vocab_size=64, init_std=0.15, seed=3).requires_grad_(False)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in policy_b.named_parameters():
            if name.startswith(("layers.1.", "lm_head")):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return policy_b, heads


def rollout(policy, heads, seed=0):
    cfg = SpeculationConfig(heads_path=None, budget="fixed", fixed_nodes=8, adaptation="slow", records_per_rollout=4096)
    engine = RolloutEngine(policy, decoder=SpeculativeDecoder(policy, cfg))
    engine.decoder.set_heads(heads)
    out = engine.generate(PROMPTS, SamplingParams(n=16, max_new_tokens=32, seed=seed))
    return out, *engine.decoder.pop_head_records()


def test_update_on_drifted_policy_commits_where_responses_it_did_not_train_on_improve(drift):
    # (Drafting itself cannot show the gain here: on this tiny policy heads trained for it,
    # the drifted ones and untrained ones all draft ~1.25 tokens per pass.)
    policy, heads = drift
    _, telemetry, records = rollout(policy, heads)
    consolidator = HeadConsolidator(heads, "every_step", DriftConfig(), ConsolidationConfig(lr=3e-3, steps=20))
    assert consolidator.observe(telemetry, records, policy_version=5) == [0, 1, 2, 3]  # every step: all heads
    assert (consolidator.replay.records.policy_version == 5).all()
    result = consolidator.update([0, 1, 2, 3], policy.lm_head.weight, policy.embed_tokens.weight)
    assert result.committed and result.version == 1 and consolidator.version == 1
    assert result.ce_after < result.ce_before and result.tv_after < result.tv_before
    train, held_out = consolidator.replay.split(ConsolidationConfig().held_out_fraction, seed=0)
    assert set(train.response.tolist()).isdisjoint(held_out.response.tolist())  # one generate call: ids unique


def test_an_update_that_hurts_held_out_records_is_rolled_back(drift):
    policy, heads = drift
    _, telemetry, records = rollout(policy, heads)
    consolidator = HeadConsolidator(heads, "every_step", DriftConfig(), ConsolidationConfig(lr=5.0, steps=3))
    consolidator.observe(telemetry, records, policy_version=0)
    params = {k: v.clone() for k, v in consolidator.heads.state_dict().items()}
    result = consolidator.update([1], policy.lm_head.weight, policy.embed_tokens.weight)
    assert not result.committed and result.ce_after > result.ce_before and consolidator.version == 0
    assert all(torch.equal(v, params[k]) for k, v in consolidator.heads.state_dict().items())
    assert not consolidator.optimizer.state  # the optimiser's moments went back too


def test_each_head_is_kept_or_rolled_back_on_its_own_held_out_records(drift):
    """Head 0, scrambled, gains from a large step that hurts the good head 1: head 0 is kept alone,
    though over both heads' records pooled the update looks like a gain."""
    policy, heads = drift
    _, telemetry, records = rollout(policy, heads)
    consolidator = HeadConsolidator(heads, "every_step", DriftConfig(), ConsolidationConfig(lr=1.0, steps=3))
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in consolidator.head_parameters(0):
            p.add_(torch.randn(p.shape, generator=g) * 2.0)
    consolidator.observe(telemetry, records, policy_version=0)
    before = {k: v.clone() for k, v in consolidator.heads.state_dict().items()}
    result = consolidator.update([0, 1], policy.lm_head.weight, policy.embed_tokens.weight)
    assert result.heads == (0, 1) and result.kept == (0,) and result.committed and consolidator.version == 1
    assert result.ce_after < result.ce_before  # pooled, the update looks good
    changed = {k for k, v in consolidator.heads.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {"blocks.0.weight", "blocks.0.bias"}
    assert set(consolidator.optimizer.state) == set(consolidator.head_parameters(0))  # head 1's moments went back


def test_updates_are_judged_on_the_same_held_out_responses_whatever_their_seed(drift):
    """A response held out once stays held out: no update is judged on records an earlier one trained on."""
    policy, heads = drift
    _, telemetry, records = rollout(policy, heads)
    consolidator = HeadConsolidator(heads, "every_step", DriftConfig(), ConsolidationConfig(lr=3e-3, steps=1))
    consolidator.observe(telemetry, records, policy_version=0)
    _, held_out = consolidator.replay.split(ConsolidationConfig().held_out_fraction)
    for seed in range(4):
        result = consolidator.update([0, 1], policy.lm_head.weight, policy.embed_tokens.weight, seed=seed)
        assert result.held_out_records == len(held_out)
        assert result.train_records == len(records) - len(held_out)


def test_heads_with_a_draft_vocabulary_are_recorded_trained_and_judged_on_it(drift):
    """Drafting proposes from the draft vocabulary alone: records take the policy's distribution
    restricted to it, and the update trains q over it, as head pretraining does."""
    policy, heads = drift
    narrow = copy.deepcopy(heads)
    vocab = torch.arange(0, 64, 2)  # odd tokens can never be drafted
    narrow.set_draft_vocab(vocab)
    _, telemetry, records = rollout(policy, narrow)
    assert set(records.target_ids.flatten().tolist()) <= set(vocab.tolist())
    assert set(records.proposal_ids.flatten().tolist()) <= set(vocab.tolist())
    mass = records.target_logp.exp().sum(1) + records.target_tail.exp()
    assert torch.allclose(mass, torch.ones_like(mass), atol=1e-4)  # renormalised over the draft vocabulary
    # The batch indexes the draft LM head's rows; a realised odd token has no row (no NLL term).
    batch = records_batch(records, 4, policy.embed_tokens.weight, "cpu", vocab)
    j, rows = records.head.long(), torch.arange(len(records))
    assert torch.equal(batch.top_idx[rows, j], records.target_ids.long() // 2)
    odd = records.token % 2 == 1
    assert odd.any() and (batch.token[rows, j][odd] == -1).all()
    assert torch.equal(batch.token[rows, j][~odd], torch.where(records.token[~odd] >= 0, records.token[~odd] // 2, -1))
    # The commit test's first-guess acceptance: p of the head's most likely draft, here head 0's by hand.
    fits = held_out_fit(narrow, narrow.draft_lm_head(policy.lm_head.weight), batch)
    zero = records.head == 0
    states = narrow.all_states(records.hidden[zero].float(), policy.embed_tokens.weight[records.path_tokens[zero].long()])
    guess = vocab[(states[:, 0] @ policy.lm_head.weight[vocab].T).argmax(1)]
    p_guess = (records.target_logp[zero].exp() * (records.target_ids[zero] == guess[:, None])).sum(1)
    assert fits[0].records == int(zero.sum()) and fits[0].first_guess == pytest.approx(float(p_guess.mean()), abs=1e-5)
    consolidator = HeadConsolidator(narrow, "every_step", DriftConfig(), ConsolidationConfig(lr=3e-3, steps=20))
    consolidator.observe(telemetry, records, policy_version=0)
    result = consolidator.update([0, 1], policy.lm_head.weight, policy.embed_tokens.weight)
    assert result.committed and result.ce_after < result.ce_before


def test_only_the_named_heads_change(drift):
    policy, heads = drift
    _, telemetry, records = rollout(policy, heads)
    consolidator = HeadConsolidator(heads, "every_step", DriftConfig(), ConsolidationConfig(lr=3e-3, steps=20))
    consolidator.observe(telemetry, records, policy_version=0)
    before = {k: v.clone() for k, v in consolidator.heads.state_dict().items()}
    assert set(records.head.tolist()) == {0, 1}  # drafts this poor rarely mature deeper
    assert consolidator.update([2, 3], policy.lm_head.weight, policy.embed_tokens.weight) is None  # no records
    # Head 0 has the most held-out records, so its update is the one the commit test keeps here;
    # head 1 has records too, so training it by mistake would show.
    assert consolidator.update([0], policy.lm_head.weight, policy.embed_tokens.weight).committed
    changed = {k for k, v in consolidator.heads.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {"blocks.0.weight", "blocks.0.bias"}


def test_slow_mode_updates_only_when_the_detector_fires(drift):
    policy, heads = drift
    _, telemetry, records = rollout(policy, heads)
    consolidator = HeadConsolidator(heads, "slow", DriftConfig(calibration_steps=2, check_every=2, min_records=1),
                                    ConsolidationConfig())
    assert [consolidator.observe(telemetry, records, policy_version=v) for v in range(6)] == [[]] * 6  # stationary


def test_old_policy_versions_age_out(drift):
    policy, heads = drift
    _, telemetry, records = rollout(policy, heads)
    consolidator = HeadConsolidator(heads, "slow", DriftConfig(), ConsolidationConfig(max_policy_lag=1))
    consolidator.observe(telemetry, records, policy_version=0)
    consolidator.observe(telemetry, records, policy_version=1)
    assert set(consolidator.replay.records.policy_version.tolist()) == {0, 1}
    consolidator.observe(telemetry, records, policy_version=2)
    assert set(consolidator.replay.records.policy_version.tolist()) == {1, 2}


def test_each_optimiser_step_trains_on_a_sample_of_at_most_batch_records(drift):
    policy, heads = drift
    _, telemetry, records = rollout(policy, heads)
    consolidator = HeadConsolidator(heads, "every_step", DriftConfig(),
                                    ConsolidationConfig(lr=3e-3, steps=20, batch_records=256))
    consolidator.observe(telemetry, records, policy_version=0)
    result = consolidator.update([0, 1, 2, 3], policy.lm_head.weight, policy.embed_tokens.weight)
    # The update's cost no longer grows with the replay.
    assert result.train_records > 4 * 256 and result.step_records == 256
    assert result.committed and result.ce_after < result.ce_before
