"""Metric namespace, rollout summaries, and the sinks: JSONL, console, W&B offline (read back with
W&B's own reader: one value per step of the live branch, across resumes and rollbacks) and disabled."""
import io
import json
import time

import numpy as np
import pytest
import torch

from specroll.configs import LoggerConfig
from specroll.learner.grpo_learner import MetricSums
from specroll.models import build_tiny_model
from specroll.rollout import GenerationStats, RolloutEngine, SamplingParams, TreeStats
from specroll.speculation import SpeculationConfig, SpeculativeDecoder
from specroll.telemetry import (
    MetricsLogger,
    StepProgress,
    acceptance_depth,
    check_metric_name,
    metric_names,
    response_metrics,
    step_summary,
    summarize_rollout_stats,
)
from specroll.telemetry.rollout_stats import tree_metrics
from specroll.telemetry.wandb_branch import BRANCH_NAME, WandbBranch, run_to_continue, start_wandb_branch
from wandb_records import wandb_history, wandb_notes

OFF = dict(backend="none", console=False)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_namespace_defines_every_family_and_rejects_other_names():
    families = {name.split("/")[0] for name in metric_names.METRICS}
    assert families == set(metric_names.FAMILIES)
    assert all(metric_names.METRICS.values())
    for name in ("train/loss", "speculation/tokens_per_step", "timing_s/head_sync", "heads/version", acceptance_depth(12)):
        check_metric_name(name)
    for name in ("train/los", "reward", "eval/acuracy", "speculation/acceptance_depth_0", "speculation/acceptance_depth_x", "rollout/"):
        with pytest.raises(ValueError, match="not in the namespace"):
            check_metric_name(name)
    with pytest.raises(ValueError, match="did you mean train/loss"):
        check_metric_name("train/los")


def test_every_per_token_learner_metric_is_in_the_namespace():
    for key in MetricSums.PER_TOKEN:
        check_metric_name(f"train/{key}")


def test_summary_of_two_actors_by_hand():
    a = GenerationStats(steps=2, active_rows_per_step=[4, 2], tokens=30, wall_time_s=2.0, prefill_s=0.1,
                        tokens_per_s=15.0,
                        tree=TreeStats(verify_steps=2, budget_per_step=[4, 8], tokens_per_step_hist={1: 2, 3: 4},
                                       tokens_per_step_mean=14 / 6, drafted_response_steps=4, drafted_tokens=10,
                                       acceptance_by_depth=[0.5, 0.25], lookup_token_share=0.5, time_draft_s=1.0,
                                       time_verify_s=2.0, time_bookkeeping_s=1.0))
    b = GenerationStats(steps=1, active_rows_per_step=[3], tokens=10, wall_time_s=4.0, prefill_s=0.1,
                        tokens_per_s=2.5,
                        tree=TreeStats(verify_steps=1, budget_per_step=[6], tokens_per_step_hist={2: 2},
                                       tokens_per_step_mean=2.0, drafted_response_steps=0, drafted_tokens=0,
                                       acceptance_by_depth=[1.0, 0.0], lookup_token_share=0.0, time_draft_s=0.0,
                                       time_verify_s=1.0, time_bookkeeping_s=0.0))
    out = summarize_rollout_stats([a, b], head_version=7)
    assert out == pytest.approx({
        "perf/gen_tokens_per_s": 40 / 4.0,  # actors run in parallel: the slowest sets the pace
        "speculation/active_rows_mean": 3.0,
        "speculation/head_version": 7.0,
        "speculation/verify_steps": 3.0,
        "speculation/tokens_per_step": (2 * 1 + 4 * 3 + 2 * 2) / 8,
        "speculation/drafted_tokens_per_step": 10 / 4,  # only the passes that drafted a tree
        "speculation/node_budget_mean": 6.0,
        "speculation/acceptance_depth_1": (0.5 * 6 + 1.0 * 2) / 8,
        "speculation/acceptance_depth_2": (0.25 * 6 + 0.0 * 2) / 8,
        "speculation/draft_time_frac": 1.0 / 5.0,
        "speculation/lookup_token_share": (0.5 * 6 + 0.0 * 2) / 8,
    })


def test_summaries_of_real_vanilla_and_speculative_rollouts():
    model = build_tiny_model(init_std=0.3)
    prompts = [[3, 4, 5], [6, 7]]
    params = SamplingParams(max_new_tokens=12, n=2, seed=1)
    vanilla = summarize_rollout_stats(RolloutEngine(model).generate(prompts, params).stats)
    assert set(vanilla) == {"perf/gen_tokens_per_s", "speculation/active_rows_mean"}
    spec_cfg = SpeculationConfig(num_heads=3, budget="fixed", fixed_nodes=4, max_nodes=4)
    engine = RolloutEngine(model, decoder=SpeculativeDecoder(model, spec_cfg))
    out = summarize_rollout_stats(engine.generate(prompts, params).stats, head_version=0)
    assert out["speculation/node_budget_mean"] == 4.0
    assert 1.0 <= out["speculation/tokens_per_step"] <= 4.0
    assert out["speculation/drafted_tokens_per_step"] == pytest.approx(out["speculation/tokens_per_step"])  # every pass drafted
    assert [name for name in out if name.startswith("speculation/acceptance_depth_")] == [acceptance_depth(d) for d in (1, 2, 3)]
    assert out["perf/gen_tokens_per_s"] > 0 and 0 < out["speculation/draft_time_frac"] < 1
    for name in out:
        check_metric_name(name)


def test_response_metrics_by_hand():
    out = response_metrics([4, 8, 12, 16], ["stop", "length", "stop", "length"], [1.0, 0.0, 1.0, 0.5],
                           correct=[True, False, True, False])
    assert out == {"rollout/response_length_mean": 10.0, "rollout/response_length_max": 16.0,
                   "rollout/clip_ratio": 0.5, "rollout/reward_mean": 0.625, "rollout/accuracy": 0.5}
    with pytest.raises(ValueError, match="one length, finish reason and reward per response"):
        response_metrics([4], ["stop", "stop"], [1.0])


def test_jsonl_sink_writes_one_parseable_line_per_step(tmp_path):
    with MetricsLogger(LoggerConfig(**OFF), tmp_path) as logger:
        logger.log(0, {"train/loss": 0.5, "rollout/reward_mean": np.float32(0.25), "train/num_sequences": 64})
        logger.log(1, {"train/loss": float("nan"), "perf/step_time_s": torch.tensor(2.5)})
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows == [
        {"step": 0, "train/loss": 0.5, "rollout/reward_mean": 0.25, "train/num_sequences": 64},
        {"step": 1, "train/loss": None, "perf/step_time_s": 2.5},  # NaN as null keeps the line strict JSON
    ]


def test_resumed_jsonl_drops_the_steps_it_will_redo(tmp_path):
    with MetricsLogger(LoggerConfig(**OFF), tmp_path) as logger:
        for step in range(4):
            logger.log(step, {"train/loss": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "train/lo')  # the crash hit mid-write
    # Resumed from the checkpoint after step 1: steps 2 and 3 run again.
    with MetricsLogger(LoggerConfig(**OFF), tmp_path, first_step=2) as logger:
        logger.log(2, {"train/loss": 20.0})
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["train/loss"]) for r in rows] == [(0, 0.0), (1, 1.0), (2, 20.0)]


def test_metrics_after_a_rollback_hold_each_step_of_the_live_lineage_once(tmp_path):
    def run(first_step, last_step, branch):
        with MetricsLogger(LoggerConfig(**OFF), tmp_path, first_step=first_step) as logger:
            for step in range(first_step, last_step):
                logger.log(step, {"train/loss": branch})

    run(0, 8, 1.0)  # steps 0-7, checkpoints after steps 3, 5 and 7
    run(4, 6, 2.0)  # resume=<the checkpoint after step 3>: a new branch redoes steps 4 and 5
    run(6, 7, 2.0)  # then resume=auto: its newest checkpoint, after step 5
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["train/loss"]) for r in rows] == [(0, 1.0), (1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0),
                                                            (5, 2.0), (6, 2.0)]


def test_a_resume_warns_once_about_steps_without_a_line_and_fills_nothing_in(tmp_path):
    with MetricsLogger(LoggerConfig(**OFF), tmp_path) as logger:
        for step in (0, 1, 2, 4, 5, 8):  # an earlier run lost the lines of steps 3, 6 and 7
            logger.log(step, {"train/loss": float(step)})
    with pytest.warns(UserWarning) as warned:
        with MetricsLogger(LoggerConfig(**OFF), tmp_path, first_step=8) as logger:
            logger.log(8, {"train/loss": 80.0})
    assert [str(w.message) for w in warned] == [
        f"{tmp_path / 'metrics.jsonl'} has no line for step(s) 3, 6-7 of the 8 before the resumed checkpoint: "
        "they stay a gap"]
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["train/loss"]) for r in rows] == [(0, 0.0), (1, 1.0), (2, 2.0), (4, 4.0), (5, 5.0), (8, 80.0)]


def test_a_resume_without_gaps_warns_nothing(tmp_path, recwarn):
    with MetricsLogger(LoggerConfig(**OFF), tmp_path) as logger:
        logger.log(0, {"train/loss": 0.0})
    with MetricsLogger(LoggerConfig(**OFF), tmp_path, first_step=1):
        pass
    assert not recwarn.list


def test_logger_rejects_bad_names_values_and_steps_before_writing(tmp_path):
    with MetricsLogger(LoggerConfig(**OFF), tmp_path) as logger:
        with pytest.raises(ValueError, match="'train/los' is not in the namespace"):
            logger.log(0, {"train/loss": 1.0, "train/los": 1.0})
        with pytest.raises(ValueError, match="'train/loss' must be a real number"):
            logger.log(0, {"train/loss": "low"})
        logger.log(0, {"train/loss": 1.0})
        with pytest.raises(ValueError, match="step 0 was logged after step 0"):
            logger.log(0, {"train/loss": 1.0})
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 1


def test_console_line(tmp_path):
    stream = io.StringIO()
    with MetricsLogger(LoggerConfig(backend="none", jsonl=False), tmp_path, console=stream) as logger:
        logger.log(3, {"rollout/reward_mean": 0.5, "perf/step_time_s": 4.2149})
    assert stream.getvalue() == "step 3 | perf/step_time_s=4.215 | rollout/reward_mean=0.5\n"


def test_wandb_offline_writes_a_run_that_a_resume_continues(offline_wandb):
    run_dir = offline_wandb / "run"
    cfg = LoggerConfig(mode="offline", console=False)
    with MetricsLogger(cfg, run_dir, config={"seed": 0}) as logger:
        run_id = logger.run_id
        logger.log(0, {"train/loss": 1.0})
    time.sleep(1.1)  # W&B names offline directories by the second: a resume within it would share the first's
    with MetricsLogger(cfg, run_dir, run_id=run_id, first_step=1) as logger:
        assert logger.run_id == run_id
        logger.log(1, {"train/loss": 0.5})
    runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 2  # one directory per process, both of the same run
    assert wandb_history(run_dir, run_id, "train/loss") == [(0, 1.0), (1, 0.5)]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1]
    assert not (offline_wandb / "wandb_dir").exists()  # the run directory, not WANDB_DIR, holds it


def test_after_a_rollback_the_wandb_run_holds_each_step_of_the_live_branch_once(offline_wandb):
    run_dir = offline_wandb / "run"

    def launch(first_step, last_step, loss, run_id):
        time.sleep(1.1)  # W&B names offline directories by the second
        with MetricsLogger(LoggerConfig(mode="offline", console=False), run_dir, run_id=run_id,
                           first_step=first_step) as logger:
            for step in range(first_step, last_step):
                logger.log(step, {"train/loss": loss})
        return logger.run_id

    abandoned = launch(0, 8, 1.0, None)  # its checkpoints after steps 3, 5 and 7 name this run
    start_wandb_branch(run_dir)  # resume=<the checkpoint after step 3> set the newer ones aside,
    branch = launch(4, 4, 2.0, abandoned)  # and the launch died at its first step;
    assert branch != abandoned and launch(4, 6, 2.0, abandoned) == branch  # its rerun continues the branch's run,
    assert launch(6, 7, 2.0, branch) == branch  # and so does resume=auto from the branch's own checkpoint
    assert wandb_history(run_dir, branch, "train/loss") == [(0, 1.0), (1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0),
                                                            (5, 2.0), (6, 2.0)]
    assert wandb_notes(run_dir, branch)[0] == (f"steps 0-3 replayed from metrics.jsonl; branched at step 4 from "
                                               f"W&B run {abandoned}, which keeps the abandoned history")
    assert wandb_history(run_dir, abandoned, "train/loss") == [(step, 1.0) for step in range(8)]
    assert not (run_dir / BRANCH_NAME).exists()  # the branch's checkpoints name its run now


def test_which_wandb_run_a_launch_continues():
    assert run_to_continue("a", 4, None) == "a"  # a resume: the run the checkpoint names
    assert run_to_continue("a", 4, WandbBranch(None, None)) is None  # a rollback: a new one
    assert run_to_continue("a", 4, WandbBranch(4, "b")) == "b"  # a rerun of the rollback's launch: its run
    assert run_to_continue("a", 4, WandbBranch(4, None)) is None  # ... which W&B, off then, never started
    assert run_to_continue("c", 6, WandbBranch(4, "b")) == "c"  # from a later checkpoint: the one it names


def test_a_rollback_without_wandb_names_no_run_in_its_checkpoints(tmp_path):
    start_wandb_branch(tmp_path)
    with MetricsLogger(LoggerConfig(**OFF, jsonl=False), tmp_path, run_id="abandoned", first_step=4) as logger:
        assert logger.run_id is None  # a later launch with W&B starts the branch's run
    assert json.loads((tmp_path / BRANCH_NAME).read_text()) == {"first_step": 4, "run_id": None}


def test_disabled_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    with MetricsLogger(LoggerConfig(mode="disabled", jsonl=False, console=False), run_dir, run_id="abc123") as logger:
        logger.log(0, {"train/loss": 1.0})
        assert logger.run_id == "abc123"  # kept for the checkpoint, so W&B can continue later
    assert not run_dir.exists() and not list(tmp_path.iterdir())


def test_progress_shows_the_step_and_its_summary():
    stream = io.StringIO()
    metrics = {"rollout/reward_mean": 0.53, "perf/gen_tokens_per_s": 1234.0, "perf/step_time_s": 4.2}
    assert step_summary(metrics) == "reward 0.53 | 1.23e+03 tok/s | 4.2 s/step"
    assert step_summary({}) == ""
    with StepProgress(total_steps=10, first_step=4, enabled=True, stream=stream) as progress:
        progress.update(4, metrics)
        progress.update(5, {"rollout/reward_mean": 0.6})
    text = stream.getvalue()
    assert "5/10" in text and "reward 0.53 | 1.23e+03 tok/s | 4.2 s/step" in text
    assert "6/10" in text and "reward 0.6" in text


def test_would_be_metrics_pool_the_actors_trees():
    def tree(passes: int, tokens: float, cost: float | None) -> TreeStats:
        return TreeStats(verify_steps=5, budget_per_step=[1] * 5, tokens_per_step_hist={1: 5}, tokens_per_step_mean=1.0,
                         drafted_response_steps=0, drafted_tokens=0, acceptance_by_depth=[], lookup_token_share=0.0,
                         time_draft_s=0.0, time_verify_s=1.0, time_bookkeeping_s=0.0, would_be_nodes=8,
                         would_be_passes=passes, would_be_tokens=tokens, tree_step_cost=cost)

    assert tree(4, 6.0, None).would_be_tokens_per_step == 1.5 and tree(0, 0.0, None).would_be_tokens_per_step is None
    out = tree_metrics([tree(4, 6.0, 3.0), tree(12, 24.0, 2.0), tree(0, 0.0, None)])
    assert out["speculation/would_be_tokens_per_step"] == pytest.approx(30 / 16)
    assert out["speculation/would_be_passes"] == 16.0 and out["speculation/would_be_nodes"] == 8.0
    assert out["speculation/tree_step_cost"] == pytest.approx((4 * 3.0 + 12 * 2.0) / 16)
    assert "speculation/would_be_tokens_per_step" not in tree_metrics([tree(0, 0.0, None)])
