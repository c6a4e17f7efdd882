"""Dynamic sampling in the driver on a real local Ray cluster: extra rounds come from the prompt
stream (its position after them is what a checkpoint keeps, so a resumed run equals an uninterrupted
one), the cap skips or trains as configured, and a speculative run and its `rollout=vanilla` twin
draw, keep and sample the same groups."""
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specroll.configs import load_train_config
from specroll.telemetry import metric_names as m
from specroll.telemetry.rollout_log import read_rollouts
from specroll.train import run_training

CONF = Path(__file__).resolve().parents[1] / "conf"
DYNAMIC = ["dynamic_sampling.enabled=true", "logger.rollouts=true", "logger.console=false"]


def config(run_dir, overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return load_train_config(compose("config", overrides=["experiment=smoke", f"run_dir={run_dir}", *DYNAMIC,
                                                              *overrides]))


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_a_skipped_step_draws_its_extra_rounds_from_the_stream_and_resume_continues_after_them(ray_cluster, tmp_path):
    """The tiny random model answers nothing right: every group lacks signal, so each step takes its four
    extra rounds of one prompt (2 + 4 prompts; a round of one goes to one of the two rollout actors) and
    skips its update at the cap. A run stopped after step 1 and resumed draws step 2's prompts after
    all of step 1's, as the uninterrupted run does."""
    common = ["dynamic_sampling.max_extra_rounds=4", "dynamic_sampling.round_prompts=1", "dynamic_sampling.at_cap=skip",
              "checkpoint_every=1", "rollout=vanilla", "cluster.num_rollout_actors=2"]
    whole = run_training(config(tmp_path / "whole", [*common, "total_steps=3"]))
    rows = read_jsonl(whole.metrics_file)
    assert [(r[m.RESAMPLE_ROUNDS], r[m.RESAMPLED_GROUPS], r[m.KEPT_GROUPS], r[m.DROPPED_GROUPS], r[m.STEP_SKIPPED])
            for r in rows] == [(4, 4, 0, 6, 1)] * 3
    assert all(r[m.TIME_RESAMPLE] > 0 and m.LOSS not in r for r in rows) and whole.policy_version == 0
    assert "resample " in whole.table  # where the step's time went
    logged = read_rollouts(tmp_path / "whole")
    assert [logged[s].prompt_indices for s in range(3)] == [list(range(6))] * 3
    assert whole.data_position == {"epoch": 1, "index": 2}  # 18 prompts of 16

    run_training(config(tmp_path / "resumed", [*common, "total_steps=2"]))
    resumed = run_training(config(tmp_path / "resumed", [*common, "total_steps=3"]))
    assert resumed.first_step == 2 and resumed.data_position == whole.data_position
    again = read_rollouts(tmp_path / "resumed")
    assert [again[s] for s in range(3)] == [logged[s] for s in range(3)]


@pytest.mark.smollm2
def test_a_speculative_run_and_its_vanilla_twin_fill_the_batch_with_the_same_groups(ray_cluster, tmp_path):
    """SmolLM2 gets a fifth of these problems right, so some groups differ and some do not. A target of
    4 groups from 2 prompts makes the step sample more; both twins draw the same prompts,
    keep the same groups (each with differing rewards) and sample the same responses."""
    common = ["experiment=quickstart", "data.prompts_per_step=2", "dynamic_sampling.target_groups=4",
              "dynamic_sampling.max_extra_rounds=8", "total_steps=1", "checkpoint_every=0", "eval_every=0",
              "logger=none"]
    runs = {}
    for mode in ("speculation", "vanilla"):
        with initialize_config_dir(config_dir=str(CONF), version_base=None):
            cfg = load_train_config(compose("config", overrides=[*common, f"rollout={mode}",
                                                                 f"run_dir={tmp_path / mode}", *DYNAMIC]))
        run_training(cfg)
        runs[mode] = (read_rollouts(tmp_path / mode), read_jsonl(Path(cfg.run_dir) / "metrics.jsonl"))
    (logged, rows), (twin_logged, twin_rows) = runs["speculation"], runs["vanilla"]
    assert logged == twin_logged
    for step in logged.values():
        assert len(step.prompt_indices) == 4
        rewards = [step.rewards[i : i + 4] for i in range(0, len(step.rewards), 4)]
        assert len(rewards) == 4 and all(len(set(group)) > 1 for group in rewards)
    names = (m.RESAMPLE_ROUNDS, m.RESAMPLED_GROUPS, m.KEPT_GROUPS, m.DROPPED_GROUPS, m.STEP_SKIPPED, m.LOSS)
    assert [[r[n] for n in names] for r in rows] == [[r[n] for n in names] for r in twin_rows]
    assert all(r[m.RESAMPLE_ROUNDS] >= 1 and r[m.KEPT_GROUPS] == 4 and r[m.STEP_SKIPPED] == 0 for r in rows)
    assert all(r[m.NUM_SEQUENCES] == 16 and r[m.TIME_RESAMPLE] > 0 for r in rows)
