"""The driver (`specroll.train`) end to end on a real local Ray cluster with a tiny model:
failures name the actor, resume=auto continues where the last checkpoint left off (in W&B too,
and a rollback in a W&B run of its own), Hydra overrides change what runs, invalid configs fail
before anything starts, errors reach the user as their message alone, the slow path's head
updates reach every rollout actor, a speculative run samples the vanilla run's responses, and a
dead launch's ownership of the run_dir is taken over."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from specroll.actors import ActorFailedError
from specroll.configs import load_train_config
from specroll.data import PromptStream, load_problems
from specroll.learner import GRPOLearner, LearnerConfig, latest_checkpoint, save_checkpoint
from specroll.models import build_tiny_model
from specroll.preflight import PreflightError
from specroll.run_owner import OWNER_NAME
from specroll.run_report import describe
from specroll.telemetry import metric_names as m
from specroll.tools.compare_runs import main as compare_main
from specroll.train import run_training
from wandb_records import wandb_history

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
# `python -m specroll.train` in a subprocess must import this checkout, not whichever one the venv has installed.
CHECKOUT_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def config(tmp_path, overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return load_train_config(compose("config", overrides=["experiment=smoke", f"run_dir={tmp_path / 'run'}",
                                                              "logger.console=false", *overrides]))


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_a_failure_before_any_checkpoint_says_a_rerun_starts_afresh(ray_cluster, tmp_path):
    cfg = config(tmp_path, ["total_steps=2", "checkpoint_every=0"])

    def kill_rollout_actor(step, metrics, actors):
        ray.kill(actors.rollout[0])

    with pytest.raises(ActorFailedError, match="rollout actor 0 died") as failure:
        run_training(cfg, on_step_end=kill_rollout_actor)
    assert "no checkpoint was completed yet, so a rerun starts from step 0" in str(failure.value)
    assert "resume=auto" not in str(failure.value)


def test_a_killed_rollout_actor_is_named_and_resume_auto_continues_then_a_rollback_branches_in_wandb(
        ray_cluster, tmp_path, offline_wandb):
    overrides = ["cluster.num_rollout_actors=2", "total_steps=3", "checkpoint_every=1", "logger=wandb_offline"]
    cfg = config(tmp_path, overrides)

    def kill_rollout_actor_1(step, metrics, actors):
        if step == 1:
            ray.kill(actors.rollout[1])

    with pytest.raises(ActorFailedError, match="rollout actor 1 died during sync_policy") as failure:
        run_training(cfg, on_step_end=kill_rollout_actor_1)
    assert "step_00000002; run again with resume=auto" in str(failure.value)

    summary = run_training(cfg)
    assert summary.first_step == 2 and summary.policy_version == 3
    fresh = PromptStream(load_problems("synthetic", synthetic=cfg.data.synthetic), cfg.data.prompts_per_step,
                         cfg.seed, cfg.data.shuffle)
    for _ in range(3):
        next(fresh)
    assert summary.data_position == fresh.state_dict()
    rows = read_jsonl(summary.metrics_file)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["train/policy_version"] for r in rows] == [1, 2, 3]
    assert [r["rollout/policy_version"] for r in rows] == [0, 1, 2]
    assert all(r["speculation/head_version"] == 0 for r in rows)
    # A step's line comes before its checkpoint and holds the saving time of the one before (none
    # at a launch's first step): the line of step 0, then step 1's with the checkpoint after step 0.
    assert [r["timing_s/checkpoint"] > 0 for r in rows] == [False, True, False]
    # One W&B run: the resumed process wrote into the run the first one started, each step once.
    run_dir, key = Path(cfg.run_dir), m.STEP_TIME_S
    runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{summary.wandb_run_id}"))
    assert len(runs) == 2 and summary.wandb_dir in map(str, runs)
    assert wandb_history(run_dir, summary.wandb_run_id, key) == [(r["step"], r[key]) for r in rows]
    assert summary.last_checkpoint.endswith("step_00000003")

    # A rollback to the checkpoint after step 1 goes on in a W&B run of its own: steps 0-1 as they
    # were, step 2 of the new branch; the first run keeps the abandoned history.
    older = Path(summary.checkpoint_dir) / "step_00000002"
    with pytest.warns(UserWarning, match="starts a new branch"):
        branch = run_training(config(tmp_path, [*overrides, f"resume={older}"]))
    branched = read_jsonl(branch.metrics_file)
    assert branch.first_step == 2 and branched[:2] == rows[:2] and branched[2][key] != rows[2][key]
    assert branch.wandb_run_id != summary.wandb_run_id
    assert wandb_history(run_dir, branch.wandb_run_id, key) == [(r["step"], r[key]) for r in branched]
    assert wandb_history(run_dir, summary.wandb_run_id, key) == [(r["step"], r[key]) for r in rows]


def test_hydra_overrides_change_what_runs(ray_cluster, tmp_path):
    cfg = config(tmp_path, ["rollout=vanilla", "rollout.max_new_tokens=8", "cluster.num_rollout_actors=2",
                            "cluster.learner_world_size=2", "cluster.overlap=true", "checkpoint_every=0"])
    summary = run_training(cfg)
    rows = read_jsonl(summary.metrics_file)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["rollout/response_length_max"] <= 8 for r in rows)
    assert not any(name.startswith(("speculation/tokens", "heads/")) for r in rows for name in r)  # vanilla decoding
    assert all(r["train/num_sequences"] == 4 for r in rows)  # both learner ranks' shares
    # Overlap: step 1 was generated with the weights of before step 0's update.
    assert [r["rollout/policy_version"] for r in rows] == [0, 0]
    assert [r["train/policy_version"] for r in rows] == [1, 2]
    assert summary.last_checkpoint is None and not Path(summary.checkpoint_dir).exists()
    # The resolved config is saved with the run, overrides included.
    saved = OmegaConf.to_container(OmegaConf.load(summary.config_file))
    assert saved == cfg.to_dict() and saved["cluster"]["num_rollout_actors"] == 2


def test_a_dead_launchs_ownership_is_taken_over_with_a_warning_and_released_at_the_end(ray_cluster, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / OWNER_NAME).write_text(json.dumps(
        {"host": os.uname().nodename, "pid": pid, "process_started": 1.0, "started": "2026-12-07T11:00:00Z"}))
    with pytest.warns(UserWarning, match=f"taking over run_dir .* from a dead launch: pid {pid} on host"):
        summary = run_training(config(tmp_path, ["total_steps=1", "checkpoint_every=0"]))
    assert [r["step"] for r in read_jsonl(summary.metrics_file)] == [0]
    assert not (tmp_path / "run" / OWNER_NAME).exists()


def test_invalid_configs_fail_before_anything_starts(tmp_path):
    result = subprocess.run([sys.executable, "-m", "specroll.train", "experiment=smoke", "cluster.num_rollout_actors=3"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300, env=CHECKOUT_ENV)
    assert result.returncode != 0
    assert ("invalid config: cluster.num_rollout_actors must be <= data.prompts_per_step (2), got 3: each rollout "
            "actor needs at least one prompt\n") == result.stderr
    assert "Ray" not in result.stdout + result.stderr

    with pytest.raises(ValueError, match="model.tokenizer must be set for training"):
        run_training(config(tmp_path, ["model.tokenizer=null"]))
    finished = tmp_path / "run" / "checkpoints" / "step_00000004"
    finished.mkdir(parents=True)
    (finished / "COMPLETE").write_text("4\n")
    with pytest.raises(ValueError, match="resume: run_dir .* already holds checkpoints .*step_00000004"):
        run_training(config(tmp_path, ["resume=never"]))


def test_limits_of_the_model_fail_before_any_actor_starts_naming_the_field(tmp_path):
    cfg = config(tmp_path, ["rollout.max_new_tokens=253", "learner.max_response_len=254"])
    with pytest.raises(PreflightError, match=r"rollout.max_new_tokens must be <= 252, got 253: it \+ "
                                             r"rollout.speculation.max_nodes \(4\) must fit in the context of "
                                             r"model.name 'tiny-llama' \(256 tokens\)"):
        run_training(cfg)
    # Preflight fails before the config is saved, and so before Ray or any actor starts.
    assert not (tmp_path / "run").exists()


def damaged_checkpoint(checkpoints: Path) -> Path:
    saved = save_checkpoint(GRPOLearner(build_tiny_model(), LearnerConfig(device="cpu")), checkpoints, step=1)
    model_states = saved / "deepspeed" / "mp_rank_00_model_states.pt"
    model_states.write_bytes(model_states.read_bytes()[:100])
    return saved


def train_in_subprocess(tmp_path, overrides, **env):
    return subprocess.run([sys.executable, "-m", "specroll.train", "experiment=smoke", f"run_dir={tmp_path / 'run'}",
                           *overrides], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**CHECKOUT_ENV, **env})


def test_a_failed_resume_prints_the_error_alone_and_exits_non_zero(tmp_path):
    saved = damaged_checkpoint(tmp_path / "elsewhere")
    message = f"error: checkpoint {saved} is damaged: deepspeed/mp_rank_00_model_states.pt has 100 bytes"

    result = train_in_subprocess(tmp_path, [f"resume={saved}"], HYDRA_FULL_ERROR="0")
    assert result.returncode == 1
    assert result.stderr.strip().startswith(message), result.stderr
    assert "Traceback" not in result.stderr and "Ray" not in result.stdout + result.stderr

    result = train_in_subprocess(tmp_path, [f"resume={saved}"], HYDRA_FULL_ERROR="1")
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "specroll.learner.checkpoint.CheckpointDamagedError" in result.stderr


# Records every step. On the smoke run's random, near-uniform policy an update has nothing to
# learn, so whether held-out responses keep it is chance: publishing a kept update to every
# rollout actor is tested in test_actors.py; here, that every actor holds what was published.
SLOW = ["cluster.num_rollout_actors=2", "data.prompts_per_step=4", "rollout.speculation.consolidation.lr=1e-4",
        "rollout.speculation.drift.calibration_steps=2", "rollout.speculation.drift.min_records=1"]


def test_head_updates_reach_the_rollout_actors_and_resume_keeps_the_detector(ray_cluster, tmp_path):
    """The slow path in a run: updates reach every rollout actor as a new head version, the step's
    telemetry shows them, and a resumed run keeps the drift detector's state and the replayed records."""
    seen = []

    def heads_held(step, metrics, actors):
        seen.append((metrics, [v.heads for v in actors.rollout_versions()]))

    run_training(config(tmp_path, [*SLOW, "rollout.speculation.adaptation=every_step", "total_steps=2"]), on_step_end=heads_held)
    (first, held_after_0), (second, held_after_1) = seen
    assert [first[m.HEADS_UPDATES], second[m.HEADS_UPDATES]] == [1, 2]  # one update each step
    # Every rollout actor holds what the consolidation actor published, and the next step drafts with it.
    assert held_after_0 == [first[m.HEADS_VERSION]] * 2 and held_after_1 == [second[m.HEADS_VERSION]] * 2
    assert second[m.HEAD_VERSION] == first[m.HEADS_VERSION]
    assert first[m.HEADS_REPLAY_RECORDS] > 0 and first[m.HEADS_UPDATE_S] > 0 and m.HEADS_LOSS in first
    assert 0 <= first[m.HEADS_UPDATE_WAIT_S] <= first[m.STEP_TIME_S]

    saved = torch.load(latest_checkpoint(Path(tmp_path / "run" / "checkpoints")) / "heads.pt", weights_only=True)
    assert saved["version"] == second[m.HEADS_VERSION] and saved["consolidation"]["detector"]["step"] == 2
    seen.clear()
    run_training(config(tmp_path, [*SLOW, "rollout.speculation.adaptation=every_step", "total_steps=3"]), on_step_end=heads_held)
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
    run_training(config(tmp_path, [*SLOW, "rollout.speculation.adaptation=slow", "total_steps=2"]),
                 on_step_end=lambda step, metrics, actors: seen.append(metrics))
    assert [s[m.HEADS_VERSION] for s in seen] == [0, 0] and [s[m.HEADS_UPDATES] for s in seen] == [0, 0]
    assert seen[-1][m.HEADS_REPLAY_RECORDS] > 0 and seen[-1][m.HEADS_DRIFT_TRIGGERS] == 0


@pytest.mark.smoke  # make test-fast's one run of the driver on Ray
def test_the_quickstart_preset_ends_with_its_table_and_curves(ray_cluster, tmp_path):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = load_train_config(compose("config", overrides=[
            "experiment=quickstart", "model=tiny", "logger=none", f"run_dir={tmp_path / 'run'}",
            "learner.max_seq_len=256", "checkpoint_every=0", "total_steps=2", "eval.limit=2", "eval.batch_size=2"]))
    summary = run_training(cfg)
    png = Path(summary.curves_file)
    assert png.parent == tmp_path / "run" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = summary.table
    for line in ("tokens per verify pass", "acceptance by depth", "generation tokens/s",
                 "reward mean, first -> last steps", "where the step's time went"):
        assert line in table
    # Held-out accuracy before training and after the last step, as the first run shows learning.
    assert "held-out accuracy, first -> last eval" in table and "(after 0 -> 2 updates)" in table
    assert "gen " in table and "update " in table  # the phases that took time are named
    described = describe(summary)
    assert f"curves:       {png}" in described and table in described


def test_a_speculative_run_samples_the_vanilla_runs_responses_and_learns_the_same(ray_cluster, tmp_path):
    """Exactness as a user sees it: the same seed with rollout=vanilla gives the same responses, step
    by step, hence the same updates, rewards and held-out evaluations (`tools.compare_runs`). The loss
    variants change updates only, so they are all on (CISPO on GSPO's sequence ratios, the mismatch
    correction, entropy-selected tokens, the soft overlong penalty)."""
    common = ["logger.rollouts=true", "checkpoint_every=0", "rollout.temperature=0.7", "rollout.top_p=0.9",
              "eval_every=2", "eval.limit=2", "eval.batch_size=2", "learner/loss=cispo",
              "learner.loss.importance_sampling_level=sequence", "learner.loss.mismatch_correction=token_truncate",
              "learner.loss.top_entropy_quantile=0.5", "learner.overlong_max_len=16", "learner.overlong_buffer_len=8"]
    runs = {}
    for mode in ("speculation", "vanilla"):
        cfg = config(tmp_path / mode, [f"rollout={mode}", *common])
        run_training(cfg)
        runs[mode] = cfg.run_dir
    out = compare_main([runs["speculation"], runs["vanilla"], "--plot", str(tmp_path / "curves.png")])
    (same,) = out["identity"].values()
    assert same["responses"] == 8 and same["identical"] == 8 and same["first_difference_step"] is None
    assert all(s["same_prompts"] and s["reward_a"] == s["reward_b"] for s in same["steps"])
    curves = list(out["held_out"].values())
    assert curves[0] == curves[1] and [updates for updates, _ in curves[0]] == [0, 2]
    assert (tmp_path / "curves.png").stat().st_size > 0
    rows = {mode: read_jsonl(Path(run_dir) / "metrics.jsonl") for mode, run_dir in runs.items()}
    assert [r[m.LOSS] for r in rows["speculation"]] == [r[m.LOSS] for r in rows["vanilla"]]
    for name in (m.CISPO_CLIP_FRAC, m.IS_WEIGHT_MEAN, m.IS_CLIPPED_FRAC, m.ENTROPY_MASK_FRAC, m.OVERLONG_PENALTY_MEAN):
        assert all(name in r for r in rows["speculation"]), name
    assert all(0.5 <= r[m.ENTROPY_MASK_FRAC] < 1 and r[m.IS_WEIGHT_MEAN] > 0 for r in rows["speculation"])
