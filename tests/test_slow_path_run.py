"""The slow path inside a real training run: a local Ray cluster, a tiny model, two rollout
actors. Head updates reach every rollout actor as a new head version, the step's telemetry
shows them, and a resumed run keeps the drift detector's state and the replayed records."""
from pathlib import Path

import pytest
import ray
import torch
from hydra import compose, initialize_config_dir

from specroll.configs import load_train_config
from specroll.learner import latest_checkpoint
from specroll.telemetry import metric_names as m
from specroll.train import run_training

CONF = Path(__file__).resolve().parents[1] / "conf"
# Records every step; a small step size, so that updates on a random policy's records still help held-out ones.
SLOW = ["experiment=smoke", "logger.console=false", "cluster.num_rollout_actors=2", "data.prompts_per_step=4",
        "rollout.spec.consolidation.lr=1e-4", "rollout.spec.drift.calibration_steps=2", "rollout.spec.drift.min_records=1"]


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False)
    yield
    ray.shutdown()


def config(tmp_path, overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return load_train_config(compose("config", overrides=[*SLOW, f"run_dir={tmp_path / 'run'}", *overrides]))


def test_head_updates_reach_the_rollout_actors_and_resume_keeps_the_detector(ray_cluster, tmp_path):
    seen = []

    def heads_held(step, metrics, actors):
        seen.append((metrics, [v["heads"] for v in actors.rollout_call("versions")]))

    run_training(config(tmp_path, ["rollout.spec.adaptation=every_step", "total_steps=2"]), on_step_end=heads_held)
    (first, held_after_0), (second, held_after_1) = seen
    assert [first[m.HEADS_UPDATES], second[m.HEADS_UPDATES]] == [1, 2]  # one update each step
    # Every rollout actor holds what the consolidation actor published, and the next step drafts with it.
    assert held_after_0 == [first[m.HEADS_VERSION]] * 2 and held_after_1 == [second[m.HEADS_VERSION]] * 2
    assert second[m.HEAD_VERSION] == first[m.HEADS_VERSION]
    assert second[m.HEADS_VERSION] >= 1  # at least one update was kept
    assert first[m.HEADS_REPLAY_RECORDS] > 0 and first[m.HEADS_UPDATE_S] > 0 and m.HEADS_LOSS in first
    assert 0 <= first[m.HEADS_UPDATE_WAIT_S] <= first[m.STEP_TIME_S]

    saved = torch.load(latest_checkpoint(Path(tmp_path / "run" / "checkpoints")) / "heads.pt", weights_only=True)
    assert saved["version"] == second[m.HEADS_VERSION] and saved["consolidation"]["detector"]["step"] == 2
    seen.clear()
    run_training(config(tmp_path, ["rollout.spec.adaptation=every_step", "total_steps=3"]), on_step_end=heads_held)
    (third, _), = seen
    resumed = torch.load(latest_checkpoint(Path(tmp_path / "run" / "checkpoints")) / "heads.pt", weights_only=True)
    detector, before = resumed["consolidation"]["detector"], saved["consolidation"]["detector"]
    assert detector["step"] == 3  # counted on from the checkpoint, not from zero
    for frozen in ("tv_median", "tv_scale", "baseline_acceptance"):  # the baselines calibrated in the first launch
        torch.testing.assert_close(detector[frozen], before[frozen], rtol=0, atol=0, equal_nan=True)
    assert third[m.HEADS_VERSION] >= saved["version"]  # continued from the checkpointed heads
    assert third[m.HEADS_UPDATES] == 1  # counted since this launch
    assert third[m.HEADS_REPLAY_RECORDS] > first[m.HEADS_REPLAY_RECORDS]  # the replayed records came back


def test_slow_mode_without_a_trigger_keeps_the_heads(ray_cluster, tmp_path):
    seen = []
    run_training(config(tmp_path, ["rollout.spec.adaptation=slow", "total_steps=2"]),
                 on_step_end=lambda step, metrics, actors: seen.append(metrics))
    assert [s[m.HEADS_VERSION] for s in seen] == [0, 0] and [s[m.HEADS_UPDATES] for s in seen] == [0, 0]
    assert seen[-1][m.HEADS_REPLAY_RECORDS] > 0 and seen[-1][m.HEADS_DRIFT_TRIGGERS] == 0
