"""A resume compares its config with its checkpoint's before Ray starts: what changes the run (learning
rate, group size, seed, data) is refused naming the field, both values and the `resume_allow_changes`
that takes it; what the checkpoint is laid out for (learner ranks) is refused with no override; what
is safe to change goes through with one line; and an allowed learning rate is the optimizer's."""
import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import pytest
import ray
import torch
from hydra import compose, initialize_config_dir

from specroll.configs import TrainConfig, load_train_config
from specroll.configs.resume_changes import RULES, check_resume_changes, leaves
from specroll.learner import GRPOLearner, GRPOSamples, LearnerConfig, load_checkpoint, save_checkpoint
from specroll.learner.checkpoint import STATE_FILE, CompletionMarker, file_records
from specroll.learner.grpo_learner import lr_multiplier
from specroll.learner.lineage import COMPLETE_MARKER
from specroll.models import build_tiny_model
from specroll.telemetry import metric_names as m
from specroll.train import run_training

ROOT = Path(__file__).resolve().parents[1]
FAST_S = 90  # far below a run's start (Ray, actors, models) on a busy 2-core machine


def config(run_dir: Path, overrides: list[str]) -> TrainConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return load_train_config(compose("config", overrides=["experiment=smoke", f"run_dir={run_dir}",
                                                              "logger.console=false", *overrides]))


def saved_checkpoint(run_dir: Path, cfg: TrainConfig, step: int = 2) -> Path:
    """A complete checkpoint's record of the run (state.json under its marker), as a save leaves it."""
    path = run_dir / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    run = cfg.to_dict() | {"run_dir": str(run_dir)}
    (path / STATE_FILE).write_text(json.dumps({"step": step, "world_size": cfg.cluster.learner_world_size,
                                               "config": {"run": run}}))
    (path / COMPLETE_MARKER).write_text(CompletionMarker(step, file_records(path)).to_json())
    (run_dir / "config.yaml").write_text("seed: 0  # the earlier launch's\n")
    return path


def refused(cfg: TrainConfig) -> str:
    started = time.monotonic()
    with pytest.raises(ValueError) as failure:
        run_training(cfg)
    assert time.monotonic() - started < FAST_S and not ray.is_initialized()
    return str(failure.value)


def test_every_config_field_has_a_resume_rule():
    assert set(leaves(TrainConfig().to_dict())) == set(RULES)


@pytest.mark.parametrize("override, was, now", [
    ("learner.lr=0.5", "0.0001", "0.5"),
    ("rollout.n=4", "2", "4"),
    ("data.synthetic.num_problems=32", "16", "32"),
    ("data.prompts_per_step=4", "2", "4"),
])
def test_a_change_to_the_run_is_refused_before_ray_starts_naming_what_takes_it(tmp_path, override, was, now):
    run_dir = tmp_path / "run"
    checkpoint = saved_checkpoint(run_dir, config(run_dir, []))
    field = override.split("=")[0]
    message = refused(config(run_dir, [override]))
    assert message == (f"resume: this launch's config differs from {checkpoint}'s ({checkpoint / STATE_FILE}):\n"
                       f"  - {field}: {was} in the checkpoint, {now} now (it changes the run; to take it: "
                       f"resume_allow_changes=[{field}])")
    assert (run_dir / "config.yaml").read_text() == "seed: 0  # the earlier launch's\n"


def test_a_seed_is_named_once_and_every_refusal_at_once(tmp_path):
    run_dir = tmp_path / "run"
    checkpoint = saved_checkpoint(run_dir, config(run_dir, []))
    message = refused(config(run_dir, ["seed=1", "learner.lr=0.5", "cluster.learner_world_size=2"]))
    assert message.splitlines()[1:] == [
        "  - learner.lr: 0.0001 in the checkpoint, 0.5 now (it changes the run; to take it: "
        "resume_allow_changes=[learner.lr])",
        "  - cluster.learner_world_size: 1 in the checkpoint, 2 now (fixed by the checkpoint: no override loads it; "
        "keep the value or start a new run_dir)",
        "  - seed: 0 in the checkpoint, 1 now (it changes the run; to take it: resume_allow_changes=[seed])",
        "  to take every change that can be: resume_allow_changes=[learner.lr,seed]",
    ]
    assert str(checkpoint) in message.splitlines()[0]


def test_allowed_and_safe_changes_go_through_with_one_line_each(tmp_path, caplog):
    run_dir = tmp_path / "run"
    checkpoint = saved_checkpoint(run_dir, config(run_dir, []))
    cfg = config(run_dir, ["seed=1", "learner.lr=0.5", "total_steps=9", "cluster.remote_timeout_s=30",
                           "resume_allow_changes=[learner,seed]"])
    with caplog.at_level(logging.INFO, logger="specroll.configs.resume_changes"):
        check_resume_changes(cfg.to_dict(), checkpoint, run_dir, cfg.resume_allow_changes)
    assert sorted(caplog.messages) == [
        "resume: cluster.remote_timeout_s 600.0 -> 30.0 (safe to change)",
        "resume: learner.lr 0.0001 -> 0.5 (allowed by resume_allow_changes)",
        "resume: learner.seed 0 -> 1 (allowed by resume_allow_changes)",
        "resume: seed 0 -> 1 (allowed by resume_allow_changes)",
        "resume: total_steps 2 -> 9 (safe to change)",
    ]


@pytest.mark.parametrize("entry, says", [
    ("learner.lrr", r"^resume_allow_changes\[0\] must be a config field or section, got 'learner.lrr'$"),
    ("learner.zero_stage", r"^resume_allow_changes\[0\] must be a field a resume may change, not one fixed by the "
                           r"checkpoint, got 'learner.zero_stage': the checkpoint cannot be loaded with another value$")])
def test_an_allowance_that_cannot_be_is_refused_with_the_config(tmp_path, entry, says):
    with pytest.raises(ValueError, match=says):
        config(tmp_path / "run", [f"resume_allow_changes=[{entry}]"])


@pytest.mark.ray
def test_an_allowed_learning_rate_is_the_one_the_optimizer_uses_after_resume(tmp_path):
    run_dir = tmp_path / "run"
    run_training(config(run_dir, ["total_steps=1"]))  # smoke: lr 1e-4, constant
    summary = run_training(config(run_dir, ["total_steps=2", "learner.lr=5e-4", "resume_allow_changes=[learner.lr]"]))
    assert summary.first_step == 1 and summary.metrics[m.LR] == pytest.approx(5e-4)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row[m.LR]) for row in rows] == [(0, pytest.approx(1e-4)), (1, pytest.approx(5e-4))]


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_a_loaded_learner_takes_its_configs_optimizer_settings_at_its_schedule_position(tmp_path, zero_stage):
    cfg = LearnerConfig(zero_stage=zero_stage, lr=1e-2, warmup_steps=3, micro_batch_tokens=16, device="cpu")
    samples = GRPOSamples([[3, 4], [5, 6, 7]], [[8, 9], [10]], torch.tensor([1.0, -1.0]))
    learner = GRPOLearner(build_tiny_model(), cfg)
    learner.update(samples)
    saved = save_checkpoint(learner, tmp_path, step=1)
    changed = replace(cfg, lr=5e-3, betas=(0.8, 0.99), weight_decay=0.1)
    resumed = GRPOLearner(build_tiny_model(), changed)
    load_checkpoint(resumed, saved)
    steps = resumed.engine.lr_scheduler.last_epoch
    assert steps == 1  # the checkpoint's rate, until applied:
    assert resumed.engine.get_lr()[0] == pytest.approx(1e-2 * lr_multiplier(steps, cfg))
    resumed.apply_optimizer_settings()
    assert resumed.engine.get_lr()[0] == pytest.approx(5e-3 * lr_multiplier(steps, changed))
    groups = resumed.engine.optimizer.param_groups
    assert all(g["betas"] == (0.8, 0.99) and g["weight_decay"] == 0.1 for g in groups)
    metrics = resumed.update(samples)  # the next step runs at the config's rate, one schedule step on
    assert metrics[m.LR] == pytest.approx(5e-3 * lr_multiplier(steps, changed))
    assert resumed.engine.get_lr()[0] == pytest.approx(5e-3 * lr_multiplier(steps + 1, changed))
