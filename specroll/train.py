"""GRPO training with exact speculative rollouts on Ray: the driver.

    python -m specroll.train experiment=quickstart      # a short SmolLM2 run on this machine
    python -m specroll.train cluster.num_rollout_actors=2 rollout=vanilla
    python -m specroll.train experiment=paper_gsm8k_qwen2_5_1_5b cluster.ray_address=auto

Each step: sample prompts -> push the latest policy to the rollout actors -> rollouts
(generate, reward) -> advantages and the learner's update -> metrics -> a checkpoint every
`checkpoint_every` steps (after the step's metrics line: no checkpoint covers a step without
one). With `cluster.overlap` the rollouts of step k+1 are generated while the learner trains
on step k, so training is one policy version off-policy.

The Hydra tree is `specroll.command_line.conf_dir()`: `conf/` next to the package, or $SPECROLL_CONF.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import hydra
import ray
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from specroll.actors import (
    ActorFailedError,
    ClusterLostError,
    LearnerUpdate,
    PendingConsolidation,
    PendingRollouts,
    Rollouts,
    RunActors,
)
from specroll.actors.ray_cluster import connect_ray
from specroll.command_line import conf_dir, errors_as_messages, refuse_renamed
from specroll.configs import TrainConfig, load_train_config
from specroll.configs.resume_changes import check_resume_changes
from specroll.data import Problem, PromptStream
from specroll.decoders import heads_config
from specroll.dynamic_sampling import FilledBatch, fill_batch
from specroll.eval.evaluation import EvalReport, eval_plan
from specroll.eval.held_out import load_held_out
from specroll.learner import latest_checkpoint
from specroll.preflight import preflight
from specroll.resume import checkpoint_to_resume, resume_advice, resume_command
from specroll.run_dir import CHECKPOINTS, CONFIG_NAME, write_run_token
from specroll.run_owner import Owner, heartbeat, release_ownership, take_ownership
from specroll.run_report import RunSummary, describe, summarize_run
from specroll.stops import RunStopped, StopSignals
from specroll.storage import write_atomically
from specroll.telemetry import (
    MetricsLogger,
    StepProgress,
    drafter_update_metrics,
    response_metrics,
    summarize_rollout_stats,
)
from specroll.telemetry import metric_names as m
from specroll.telemetry.history import eval_file
from specroll.telemetry.rollout_log import ROLLOUTS_NAME, RolloutLog

# The phases of a step, in order, as `run_training`'s `on_phase` sees them begin.
WEIGHT_SYNC, GENERATE, HEAD_UPDATE, TRAIN, SAVE = "weight_sync", "generate", "head_update", "train", "save"
STEP_PHASES = (WEIGHT_SYNC, GENERATE, HEAD_UPDATE, TRAIN, SAVE)
OnPhase = Callable[[int, str, RunActors], None]
NO_UPDATE = LearnerUpdate({}, 0.0, 0.0, 0)  # a step dynamic sampling skips


@dataclass
class Run:
    """One launch of a run: what `prepare` sets up, `train_loop` advances and `teardown` ends."""

    cfg: TrainConfig
    owner: Owner | None = None  # this launch, once it owns run_dir: released at the end
    started_ray: bool = False  # Ray was started here, so it is shut down here
    actors: RunActors | None = None
    stream: PromptStream | None = None
    logger: MetricsLogger | None = None  # set last: a run with a logger has begun its steps
    rollout_log: RolloutLog | None = None  # every response, with logger.rollouts
    first_step: int = 0  # the resumed checkpoint's step; 0 afresh
    last_checkpoint: str | None = None  # the newest one written or resumed from
    held_out: list[Problem] | None = None  # the problems `eval_every` evaluates on; None without
    last_eval: str | None = None  # the newest evaluation's file of this launch
    stops: StopSignals | None = None  # turns SIGTERM and SIGINT into `RunStopped` (`specroll.stops`)
    step: int | None = None  # the step under way, and its phase (`STEP_PHASES`), for a stop to name
    phase: str | None = None

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run_dir)

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / CHECKPOINTS

    @property
    def waits_for_heads(self) -> bool:
        """Whether a step waits for the slow path's head update before the learner's."""
        spec = heads_config(self.cfg.rollout)
        return spec is not None and spec.consolidation.wait


class LaunchedRollouts(NamedTuple):
    """A step's rollouts on their way, and what the driver measured launching them."""

    pending: PendingRollouts
    weight_sync_s: float  # seconds pushing the latest policy to the rollout actors first
    data_position: dict  # the prompt stream's `state_dict()` after this step's batch


def run_training(cfg: TrainConfig, on_step_end: Callable[[int, dict, RunActors], None] | None = None,
                 on_phase: OnPhase | None = None) -> RunSummary:
    """Train as `cfg` says, from its latest checkpoint when `cfg.resume` allows.

    `on_step_end(step, metrics, actors)` runs after each step (its metrics logged, its checkpoint
    saved), and `on_phase(step, phase, actors)` as each of `STEP_PHASES` begins (notebooks, tests:
    the fault tests kill an actor there). SIGTERM and SIGINT end the run at once (`specroll.stops`:
    a checkpoint being saved is finished first) with `RunStopped`, once the run is torn down.
    """
    run = Run(cfg)
    with StopSignals() as run.stops:
        try:
            prepare(run)
            steps = train_loop(run, on_step_end, on_phase)
            return summarize_run(run.cfg, steps, run.first_step, run.logger, policy_version=run.actors.learner_version,
                                 data_position=run.stream.state_dict(), last_checkpoint=run.last_checkpoint,
                                 last_eval=run.last_eval)
        except (ActorFailedError, ClusterLostError) as exc:
            if run.logger is None:  # failed while starting: nothing ran that a resume would continue
                raise
            raise type(exc)(f"{exc}\n  {resume_advice(run.checkpoints)}") from exc
        except KeyboardInterrupt:
            if run.stops.received is None:  # Ctrl-C outside the main thread's handlers
                raise
            stop = RunStopped(run.stops.received)
            if run.step is not None:
                stop.where = f"during step {run.step} ({run.phase})"
            stop.checkpoint = latest_checkpoint(run.checkpoints)
            raise stop from None
        finally:
            teardown(run)


def prepare(run: Run) -> None:
    """Everything before the first step: every input checked (before anything is written), the
    run_dir's ownership (refused while another launch holds it), the checkpoint to resume (and what this
    launch would change of it: `resume_changes`), the saved config and run token, Ray, the actors (the
    model staged once for all of them, each seeing the run_dir), the restored state and the logger."""
    check_runnable(run.cfg)
    inputs = preflight(run.cfg)
    run.cfg = cfg = inputs.cfg  # run_dir and local paths absolute, for every actor on every node
    if cfg.eval_every:
        run.held_out = load_held_out(cfg.data, cfg.eval)
    run.owner = take_ownership(run.run_dir)
    resume_from = checkpoint_to_resume(cfg, run.checkpoints)
    if resume_from is not None:
        check_resume_changes(cfg.to_dict(), resume_from, run.run_dir, cfg.resume_allow_changes)
    save_resolved_config(cfg, run.run_dir)
    token = write_run_token(run.run_dir)
    with run.stops.around_ray_init():
        run.started_ray = connect_ray(cfg.cluster)
    run.actors = RunActors.start(cfg)
    run.actors.check_run_dir(cfg.run_dir, token)
    resumed = run.actors.restore(str(resume_from)) if resume_from is not None else None
    run.stream = PromptStream(inputs.problems, cfg.data.prompts_per_step, cfg.seed, cfg.data.shuffle)
    if resumed:
        run.first_step, run.last_checkpoint = resumed.step, str(resumed.path)
        run.stream.load_state_dict(resumed.data_position)
    if cfg.logger.rollouts:
        run.rollout_log = RolloutLog(run.run_dir / ROLLOUTS_NAME, run.first_step)
    run.logger = MetricsLogger(cfg.logger, run.run_dir, config=cfg.to_dict(),
                               run_id=resumed.wandb_run_id if resumed else None, first_step=run.first_step)




def train_loop(run: Run, on_step_end: Callable[[int, dict, RunActors], None] | None = None,
               on_phase: OnPhase | None = None) -> list[dict[str, float]]:
    """Steps `run.first_step` to `total_steps - 1`; returns each step's metrics.

    A step: rollouts, the slow path's head update (overlapping the learner's), the learner's
    update, metrics, then a checkpoint when due: a crash between the two leaves the step's line
    and the checkpoint before it, and the resumed run redoes the step, replacing that line. A
    step's record holds the saving time of the checkpoint before it. With `cluster.overlap` the
    next step's rollouts are generated while the learner trains on this one.
    """
    cfg, actors, steps = run.cfg, run.actors, []

    def phase(step: int, name: str) -> None:
        if step == run.step:
            run.phase = name
        if on_phase is not None:
            on_phase(step, name, actors)

    if run.first_step == 0 and cfg.eval_every and cfg.eval.before_training:
        initial = evaluate_policy(run, 0)
        tqdm.write(f"before training: held-out accuracy {initial[m.EVAL_ACCURACY]:.2f} ({run.last_eval})")
    with StepProgress(cfg.total_steps, run.first_step) as progress:
        launched = None  # the next step's rollouts, when launched early (overlap)
        checkpoint_s = 0.0  # saving the checkpoint after the previous step
        for step in range(run.first_step, cfg.total_steps):
            run.step, run.phase, started = step, WEIGHT_SYNC, time.perf_counter()
            current = launched if launched is not None else start_rollouts(run, step, phase)
            launched = None
            phase(step, GENERATE)
            rollouts = collect_with_progress(actors, current.pending, cfg)
            filled = fill_with_signal(run, rollouts) if cfg.dynamic_sampling.enabled else None
            data_position = current.data_position if filled is None else run.stream.state_dict()
            if filled is not None:
                rollouts = filled.rollouts
            phase(step, HEAD_UPDATE)
            consolidating = actors.start_consolidation(rollouts)  # the slow path overlaps the update ...
            update_wait_s = actors.finish_consolidation(consolidating) if run.waits_for_heads else 0.0
            if cfg.cluster.overlap and step + 1 < cfg.total_steps:
                launched = start_rollouts(run, step + 1, phase)  # generates while the learner trains on this step
            phase(step, TRAIN)
            trained = NO_UPDATE if filled is not None and filled.skip else actors.train(rollouts)
            if not run.waits_for_heads:  # ... and the next rollout drafts with the heads it publishes
                update_wait_s = actors.finish_consolidation(consolidating)
            evaluation = evaluate_if_due(run, step)
            heads = heads_metrics(actors, consolidating, update_wait_s)
            metrics = step_metrics(rollouts, trained, heads, current.weight_sync_s, checkpoint_s,
                                   time.perf_counter() - started + checkpoint_s)
            metrics.update(evaluation)
            metrics.update(filled.metrics if filled is not None else {})
            run.logger.log(step, metrics)  # before the checkpoint that covers the step
            heartbeat(run.run_dir)
            if run.rollout_log is not None:
                run.rollout_log.write(rollouts)
            progress.update(step, metrics)
            steps.append(metrics)
            if checkpoint_due(cfg, step):
                phase(step, SAVE)
            checkpoint_s = save_if_due(run, step, data_position)
            if on_step_end is not None:
                on_step_end(step, metrics, actors)
    return steps


def start_rollouts(run: Run, step: int, phase: Callable[[int, str], None]) -> LaunchedRollouts:
    """Draw the step's prompts, push the latest policy, launch generation."""
    batch = next(run.stream)
    position = run.stream.state_dict()
    phase(step, WEIGHT_SYNC)
    started = time.perf_counter()
    run.actors.sync_policy()
    return LaunchedRollouts(run.actors.start_rollouts(step, batch), time.perf_counter() - started, position)


def fill_with_signal(run: Run, first: Rollouts) -> FilledBatch:
    """Dynamic sampling: the step's groups with reward signal, extra rounds drawn from the prompt
    stream and generated by the rollout actors with the policy that sampled `first`."""
    def sample(first_index: int, count: int) -> Rollouts:
        return run.actors.collect_rollouts(run.actors.start_rollouts(first.step, run.stream.take(count), first_index))

    cfg = run.cfg
    return fill_batch(first, cfg.target_groups, cfg.dynamic_sampling, cfg.cluster.learner_world_size, sample,
                      time.perf_counter)


def save_if_due(run: Run, step: int, data_position: dict) -> float:
    """A checkpoint after step `step` when `checkpoint_every` asks for one; returns the seconds it took."""
    cfg = run.cfg
    if not checkpoint_due(cfg, step):
        return 0.0
    started = time.perf_counter()
    with run.stops.deferred():  # a stop lets the save finish: the run ends on a complete checkpoint
        run.last_checkpoint = run.actors.save(str(run.checkpoints), step + 1, data_position, run.logger.run_id,
                                              cfg.to_dict(), cfg.keep_last)
        run.phase = f"{SAVE}d checkpoint {Path(run.last_checkpoint).name}"
    return time.perf_counter() - started


def evaluate_if_due(run: Run, step: int) -> dict[str, float]:
    """The policy after step `step` on the held-out problems when `eval_every` asks (and after the
    last step): `eval/*` and its time, the report written to evals/; empty on other steps."""
    cfg, done = run.cfg, step + 1
    if not cfg.eval_every or (done % cfg.eval_every and done != cfg.total_steps):
        return {}
    return evaluate_policy(run, done)


def evaluate_policy(run: Run, done: int) -> dict[str, float]:
    """The learner's policy (after `done` updates) on the held-out problems: `eval/*` and its time;
    the report written to evals/."""
    cfg = run.cfg
    started, plan = time.perf_counter(), eval_plan(cfg.rollout, cfg.eval)
    version = run.actors.sync_policy()
    results = run.actors.evaluate(run.held_out, plan, cfg.eval.batch_size)
    report = EvalReport(f"{cfg.run_dir} (policy version {version})", done, results, plan.ks)
    run.last_eval = str(report.write(eval_file(cfg.run_dir, done)))
    return {**report.metrics(), m.TIME_EVAL: time.perf_counter() - started}


def heads_metrics(actors: RunActors, consolidating: PendingConsolidation | None,
                  update_wait_s: float) -> dict[str, float]:
    """The consolidation actor's heads/* and timing since the last step, with the wait for its update."""
    heads = actors.heads_metrics()
    if consolidating is not None:
        heads[m.HEADS_UPDATE_WAIT_S] = update_wait_s
    return heads


def teardown(run: Run) -> None:
    """Close what the run opened (the logger, the actors, Ray if started here), in that order, then
    give up the run_dir: the actors have stopped writing there."""
    if run.logger is not None:
        run.logger.close()
    if run.rollout_log is not None:
        run.rollout_log.close()
    if run.actors is not None:
        run.actors.shutdown()
    if run.started_ray:
        ray.shutdown()
    if run.owner is not None:
        release_ownership(run.run_dir, run.owner)


def check_runnable(cfg: TrainConfig) -> None:
    """What the run needs beyond a valid config, checked before any actor starts."""
    if cfg.model.tiny_type is not None and cfg.model.tokenizer is None:
        raise ValueError("model.tokenizer must be set for training: prompts are formatted and responses scored as text")
    c = cfg.cluster
    if c.learner_world_size > 1 and 0 < c.gpus_per_learner < 1:
        raise ValueError(f"cluster.gpus_per_learner must be 0 or >= 1 with several learner ranks, got "
                         f"{c.gpus_per_learner}: NCCL ranks cannot share a GPU")


def save_resolved_config(cfg: TrainConfig, run_dir: Path) -> None:
    """The config this launch runs with, as `run_dir/config.yaml` (a resumed launch replaces
    it; every checkpoint keeps the config it was saved under)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(run_dir / CONFIG_NAME, OmegaConf.to_yaml(cfg.to_dict()))


def collect_with_progress(actors: RunActors, pending: PendingRollouts, cfg: TrainConfig) -> Rollouts:
    total = cfg.data.prompts_per_step * cfg.rollout.n
    with tqdm(total=total, desc=f"rollouts of step {pending.step}", unit="response", leave=False,
              disable=None) as bar:
        return actors.collect_rollouts(pending, on_shard=lambda shard: bar.update(len(shard.response_ids)))


def checkpoint_due(cfg: TrainConfig, step: int) -> bool:
    done = step + 1
    return cfg.checkpoint_every > 0 and (done % cfg.checkpoint_every == 0 or done == cfg.total_steps)


def step_metrics(rollouts: Rollouts, trained: LearnerUpdate, heads: dict, weight_sync_s: float, checkpoint_s: float,
                 step_s: float) -> dict[str, float]:
    metrics = response_metrics([len(r) for r in rollouts.response_ids], rollouts.finish_reasons, rollouts.rewards,
                               rollouts.correct)
    metrics[m.ROLLOUT_POLICY_VERSION] = float(rollouts.policy_version)
    metrics.update(summarize_rollout_stats(rollouts.engine_stats, rollouts.head_version))
    metrics.update(drafter_update_metrics(rollouts.drafter_updates))
    metrics.update(trained.metrics)
    metrics.update(heads)
    metrics.update({
        m.TIME_GEN: rollouts.gen_s,
        m.TIME_REWARD: rollouts.reward_s,
        m.TIME_OLD_LOGPROB: trained.old_logprob_s,
        m.TIME_UPDATE: trained.update_s,
        m.TIME_WEIGHT_SYNC: weight_sync_s,
        m.TIME_CHECKPOINT: checkpoint_s,
        m.TRAIN_TOKENS_PER_S: trained.tokens / max(trained.update_s, 1e-9),
        m.STEP_TIME_S: step_s,
    })
    return metrics


@hydra.main(config_path=conf_dir(), config_name="config", version_base=None)
def main(hydra_cfg: DictConfig) -> None:
    with errors_as_messages("invalid config"):
        cfg = load_train_config(hydra_cfg)
        check_runnable(cfg)
    with errors_as_messages("error"):
        try:
            summary = run_training(cfg)
        except RunStopped as stop:
            stop.command = resume_command(HydraConfig.get().overrides.task)
            print(stop, file=sys.stderr, flush=True)
            raise SystemExit(stop.exit_code) from None
        print(describe(summary), flush=True)


if __name__ == "__main__":
    refuse_renamed(sys.argv[1:])
    main()
