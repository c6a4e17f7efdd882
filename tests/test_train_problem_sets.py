"""Training runs on problem sets: a MATH-style run whose rewards come from math-verify; a run and its
resume that never meet the long prompts data.long_prompts=drop left out."""
import json
import os
from pathlib import Path

import psutil
import ray
from hydra import compose, initialize_config_dir

from specroll.configs import load_train_config
from specroll.data import PromptStream
from specroll.preflight import preflight
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


def test_dropped_long_prompts_never_reach_a_run_nor_its_resume(ray_cluster, tmp_path):
    short = [f"Tom has {k} apples and buys 2 more. How many apples does he have?" for k in (1, 2, 3)]
    long = "Count the words: " + "one " * 400  # over the tiny model's 256-token context: generate would refuse it
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "#### 5"}) + "\n"
                            for q in (short[0], long, short[1], long, short[2])))
    overrides = ["experiment=smoke", f"run_dir={tmp_path / 'run'}", "logger.console=false", "data=gsm8k",
                 f"data.path={data}", "data.long_prompts=drop"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        first, resumed = (load_train_config(compose("config", overrides=[*overrides, f"total_steps={n}"]))
                          for n in (2, 3))
    kept = preflight(first).problems
    assert [p.question for p in kept] == short
    stream = PromptStream(kept, first.data.prompts_per_step, first.seed, first.data.shuffle)

    summary = run_training(first)
    next(stream), next(stream)
    assert summary.data_position == stream.state_dict()  # positions in the kept problems: epoch 1 after 4 of 3
    summary = run_training(resumed)
    next(stream)
    assert summary.first_step == 2 and summary.data_position == stream.state_dict()
