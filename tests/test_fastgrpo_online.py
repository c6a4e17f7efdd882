"""Online draft learning of the FastGRPO-style baseline: an update on a step's responses lowers the
draft loss on them, its state survives a save and restore exactly, and its metrics."""
from __future__ import annotations

import copy

import pytest
import torch

from specroll.fastgrpo import FastGRPOConfig, FastGRPODecoder, FeatureDrafter, OnlineConfig
from specroll.fastgrpo.online import DrafterUpdate, OnlineDrafterLearner
from specroll.models import build_tiny_model
from specroll.rollout import RolloutEngine, SamplingParams
from specroll.telemetry import drafter_update_metrics
from specroll.telemetry import metric_names as m

PROMPTS = [[3, 5, 2], [2, 6], [4, 4, 7, 3, 0, 5]]


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(vocab_size=16, eos_token_ids=[1], init_std=0.2, seed=3).requires_grad_(False)


def step_data(model, drafter, seed: int):
    """A rollout step's responses with the features its verify passes logged."""
    cfg = FastGRPOConfig(drafter_path=None, capacity=1000, max_nodes=8)
    engine = RolloutEngine(model, decoder=FastGRPODecoder(model, cfg))
    engine.decoder.set_drafter(drafter)
    out = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=32, n=16, seed=seed))
    return engine.decoder.pop_training_data(out.token_ids)


def test_an_online_update_lowers_the_draft_loss_on_the_steps_data(model):
    """FastGRPO's settings (lr 1e-4, one epoch), in optimiser steps of 128 tokens."""
    drafter = FeatureDrafter.for_model(model)
    learner = OnlineDrafterLearner(drafter, model, OnlineConfig(batch_tokens=128))
    data = step_data(model, drafter, seed=0)
    before = learner.loss(data)
    update = learner.update(data)
    after = learner.loss(data)
    assert after < 0.995 * before, (before, after)  # deterministic: no sampling in the loss
    assert update.updates == drafter.updates == 1 and update.entries == data.num_entries and update.seconds > 0
    # The drafting copy took the master's weights.
    for name, value in learner.master.state_dict().items():
        torch.testing.assert_close(drafter.state_dict()[name], value)


def test_the_online_state_survives_save_and_restore(model, tmp_path):
    """A learner restored from a checkpointed state takes exactly the update the original takes."""
    cfg = OnlineConfig(lr=1e-3, batch_tokens=10**6)  # one batch per update: no shuffling to replay
    original = OnlineDrafterLearner(FeatureDrafter.for_model(model), model, cfg)
    original.update(step_data(model, original.drafter, seed=1))
    torch.save(original.state_dict(), tmp_path / "drafter.pt")
    restored = OnlineDrafterLearner(FeatureDrafter.for_model(model, seed=9), model, cfg)
    restored.load_state_dict(torch.load(tmp_path / "drafter.pt", weights_only=True))
    assert restored.updates == restored.drafter.updates == 1
    data = step_data(model, original.drafter, seed=2)
    a, b = original.update(copy.deepcopy(data)), restored.update(data)
    assert a.loss == pytest.approx(b.loss, rel=1e-6) and b.updates == 2
    for name, value in original.drafter.state_dict().items():
        torch.testing.assert_close(restored.drafter.state_dict()[name], value)


def test_a_drafter_for_another_policy_is_refused(model):
    learner = OnlineDrafterLearner(FeatureDrafter.for_model(model), model, OnlineConfig())
    other = build_tiny_model(vocab_size=32, seed=3)
    with pytest.raises(ValueError, match="the checkpointed drafter was made for model"):
        OnlineDrafterLearner(FeatureDrafter.for_model(other), other, OnlineConfig()).load_state_dict(learner.state_dict())


def test_drafter_update_metrics():
    assert drafter_update_metrics([]) == {}
    metrics = drafter_update_metrics([DrafterUpdate(2.0, 0.5, 100, 3), DrafterUpdate(3.0, 0.7, 80, 3)])
    assert metrics == {m.TIME_DRAFTER_UPDATE: 3.0, m.DRAFTER_UPDATES: 3.0, m.DRAFTER_LOSS: pytest.approx(0.6)}
