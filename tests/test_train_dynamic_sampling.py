"""Dynamic sampling in the driver on a real local Ray cluster: extra rounds come from the prompt
stream (its position after them is what a checkpoint keeps, so a resumed run equals an uninterrupted
one), the cap skips as configured, and a speculative run and its `rollout=vanilla` twin draw and
sample the same rounds (which groups a step keeps, a function of their rewards: test_dynamic_sampling.py)."""
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


# The tiny random model answers nothing right: every group lacks signal, so each step takes its four
# extra rounds of one prompt (2 + 4 prompts; a round of one goes to one of the two rollout actors) and
# skips its update at the cap.
ROUNDS = ["dynamic_sampling.max_extra_rounds=4", "dynamic_sampling.round_prompts=1", "dynamic_sampling.at_cap=skip",
          "checkpoint_every=1", "cluster.num_rollout_actors=2"]


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, tmp_path_factory):
    """A vanilla run of three steps, and what it logged."""
    run_dir = tmp_path_factory.mktemp("whole")
    return run_training(config(run_dir, [*ROUNDS, "rollout=vanilla", "total_steps=3"])), read_rollouts(run_dir)


def test_a_skipped_step_draws_its_extra_rounds_from_the_stream_and_resume_continues_after_them(uninterrupted, tmp_path):
    """A run stopped after step 1 and resumed draws step 2's prompts after all of step 1's, as the
    uninterrupted run does."""
    whole, logged = uninterrupted
    rows = read_jsonl(whole.metrics_file)
    assert [(r[m.RESAMPLE_ROUNDS], r[m.RESAMPLED_GROUPS], r[m.KEPT_GROUPS], r[m.DROPPED_GROUPS], r[m.STEP_SKIPPED])
            for r in rows] == [(4, 4, 0, 6, 1)] * 3
    assert all(r[m.TIME_RESAMPLE] > 0 and m.LOSS not in r for r in rows) and whole.policy_version == 0
    assert "resample " in whole.table  # where the step's time went
    assert [logged[s].prompt_indices for s in range(3)] == [list(range(6))] * 3
    assert whole.data_position == {"epoch": 1, "index": 2}  # 18 prompts of 16

    run_training(config(tmp_path, [*ROUNDS, "rollout=vanilla", "total_steps=2"]))
    resumed = run_training(config(tmp_path, [*ROUNDS, "rollout=vanilla", "total_steps=3"]))
    assert resumed.first_step == 2 and resumed.data_position == whole.data_position
    again = read_rollouts(tmp_path)
    assert [again[s] for s in range(3)] == [logged[s] for s in range(3)]


def test_a_speculative_run_and_its_vanilla_twin_draw_and_sample_the_same_rounds(uninterrupted, tmp_path):
    """Every round's prompts, responses and rewards, and every step's counts, as the vanilla run's."""
    whole, logged = uninterrupted
    twin = run_training(config(tmp_path, [*ROUNDS, "rollout=speculation", "total_steps=3"]))
    assert read_rollouts(tmp_path) == logged
    names = (m.RESAMPLE_ROUNDS, m.RESAMPLED_GROUPS, m.KEPT_GROUPS, m.DROPPED_GROUPS, m.STEP_SKIPPED)
    assert [[r[n] for n in names] for r in read_jsonl(twin.metrics_file)] == [
        [r[n] for n in names] for r in read_jsonl(whole.metrics_file)]
