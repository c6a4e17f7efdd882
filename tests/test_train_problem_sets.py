"""A MATH-style training run on the fixture problems: GRPO steps whose rewards come from math-verify."""
import json
import os
from pathlib import Path

import psutil
import ray
from hydra import compose, initialize_config_dir

from specroll.configs import load_train_config
from specroll.train import run_training

ROOT = Path(__file__).resolve().parents[1]
WORKER = "specroll.data.verifier_worker"


def test_a_math_style_run_trains_with_math_verify_rewards(ray_cluster, tmp_path):
    overrides = ["experiment=smoke", f"run_dir={tmp_path / 'run'}", "logger.console=false", "checkpoint_every=0",
                 "data=math", f"data.path={ROOT / 'tests' / 'data' / 'math_mini.jsonl'}", "data.records.levels=[2,3,4,5]"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = load_train_config(compose("config", overrides=overrides))
    assert cfg.data.reward.function == "math_verify"
    verifier_workers = []

    def find_verifier_worker(step, metrics, actors):
        # The rollout actor scored this step's responses through its math-verify worker process.
        pid = ray.get(actors.rollout[0].__ray_call__.remote(lambda actor: os.getpid()))
        commands = [" ".join(child.cmdline()) for child in psutil.Process(pid).children()]
        verifier_workers.append(sum(WORKER in command for command in commands))

    summary = run_training(cfg, on_step_end=find_verifier_worker)
    rows = [json.loads(line) for line in Path(summary.metrics_file).read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1]
    assert [row["train/policy_version"] for row in rows] == [1, 2]  # the learner updated after each step
    assert verifier_workers == [1, 1]  # one worker, started once and kept
    assert all(0.0 <= row["rollout/reward_mean"] <= 1.0 for row in rows)
