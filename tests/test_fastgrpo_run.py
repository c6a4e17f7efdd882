"""rollout=fastgrpo through the driver on a real local Ray cluster with a tiny model: every step
pays for an online drafter update in each rollout actor, checkpoints keep each actor's drafter,
and resuming continues their online learning."""
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from specroll.configs import load_train_config
from specroll.learner.checkpoint import DRAFTER_FILE
from specroll.telemetry import metric_names as m
from specroll.train import run_training

CONF = Path(__file__).resolve().parents[1] / "conf"


def config(tmp_path, overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return load_train_config(compose("config", overrides=[
            "experiment=smoke", "rollout=fastgrpo", "rollout.fastgrpo.capacity=8", "rollout.fastgrpo.drafter_path=null",
            "cluster.num_rollout_actors=2", f"run_dir={tmp_path / 'run'}", "logger.console=false", *overrides]))


def test_fastgrpo_learns_online_every_step_and_resumes_its_drafters(ray_cluster, tmp_path):
    summary = run_training(config(tmp_path, ["total_steps=2"]))
    rows = [json.loads(line) for line in Path(summary.metrics_file).read_text().splitlines()]
    assert [r[m.DRAFTER_UPDATES] for r in rows] == [1, 2]
    assert all(r[m.TIME_DRAFTER_UPDATE] > 0 and r[m.DRAFTER_LOSS] > 0 and r[m.TOKENS_PER_STEP] >= 1 for r in rows)
    assert all(m.HEAD_VERSION not in r for r in rows)  # no horizon heads, no consolidation actor
    saved = torch.load(Path(summary.last_checkpoint) / DRAFTER_FILE, weights_only=True)
    assert len(saved) == 2 and all(state["meta"]["updates"] == 2 for state in saved)

    seen = {}
    resumed = run_training(config(tmp_path, ["total_steps=3"]),
                           on_step_end=lambda step, metrics, actors: seen.update(metrics))
    assert resumed.first_step == 2 and seen[m.DRAFTER_UPDATES] == 3
    # Each actor went on from its own checkpointed optimiser state: AdamW counted the earlier steps.
    final = torch.load(Path(resumed.last_checkpoint) / DRAFTER_FILE, weights_only=True)
    for before, after in zip(saved, final):
        steps = [s["step"] for s in after["optimizer"]["state"].values()]
        assert all(s > max(t["step"] for t in before["optimizer"]["state"].values()) for s in steps)
