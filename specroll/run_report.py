"""What a run hands back at its end (`RunSummary`): where its checkpoints, config, metrics, W&B
run, last evaluation and curves are, and its end-of-run table; `describe` says it to the user."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specroll.configs import TrainConfig
from specroll.run_dir import CHECKPOINTS, CONFIG_NAME
from specroll.telemetry import MetricsLogger
from specroll.telemetry.history import STEP_KEY, RunHistory, held_out_curve, read_run
from specroll.telemetry.plots import plot_run_curves
from specroll.telemetry.run_summary import format_summary
from specroll.telemetry.sinks import JSONL_NAME

CURVES_NAME = "run_curves.png"  # under run_dir: the run's curves, drawn at its end


@dataclass(frozen=True)
class RunSummary:
    """What `run_training` hands back, and `describe` prints."""

    run_dir: str
    first_step: int  # the step this launch began at
    total_steps: int
    policy_version: int | None  # the learner's, at the end
    data_position: dict  # the prompt stream's `state_dict()` at the end
    last_checkpoint: str | None  # the newest checkpoint written or resumed from; None without any
    checkpoint_dir: str
    config_file: str  # the resolved config of this launch
    metrics_file: str | None  # metrics.jsonl; None without logger.jsonl
    wandb_run_id: str | None
    wandb_dir: str | None  # the offline run's directory, or the run's URL online; None without W&B
    metrics: dict[str, float]  # of the last step; empty when no step ran
    last_eval: str | None  # this launch's newest held-out evaluation (evals/step_XXXXXXXX.json); None without
    curves_file: str | None  # the run's curves as a PNG; None without steps
    table: str | None  # the end-of-run table; None without steps


def summarize_run(cfg: TrainConfig, steps: list[dict[str, float]], first_step: int, logger: MetricsLogger, *,
                  policy_version: int | None, data_position: dict, last_checkpoint: str | None,
                  last_eval: str | None) -> RunSummary:
    """The run's curves and end-of-run table (from metrics.jsonl, else this launch's `steps`, the
    first of them step `first_step`) and where things are."""
    run_dir = Path(cfg.run_dir)
    if cfg.logger.jsonl:
        history = read_run(run_dir)
    else:
        rows = [{STEP_KEY: step, **metrics} for step, metrics in enumerate(steps, start=first_step)]
        history = RunHistory(run_dir.name, rows, held_out_curve(run_dir))
    curves_file, table = curves_and_table(history, run_dir / CURVES_NAME)
    return RunSummary(
        run_dir=str(run_dir),
        first_step=first_step,
        total_steps=cfg.total_steps,
        policy_version=policy_version,
        data_position=data_position,
        last_checkpoint=last_checkpoint,
        checkpoint_dir=str(run_dir / CHECKPOINTS),
        config_file=str(run_dir / CONFIG_NAME),
        metrics_file=str(run_dir / JSONL_NAME) if cfg.logger.jsonl else None,
        wandb_run_id=logger.run_id,
        wandb_dir=wandb_location(logger),
        metrics=steps[-1] if steps else {},
        last_eval=last_eval,
        curves_file=curves_file,
        table=table,
    )


def curves_and_table(history: RunHistory, curves_path: Path) -> tuple[str | None, str | None]:
    """The run's curves drawn to `curves_path`, and its end-of-run table; (None, None) without steps."""
    if not history.rows:
        return None, None
    plot_run_curves(history, curves_path)
    return str(curves_path), format_summary(history)


def wandb_location(logger: MetricsLogger) -> str | None:
    """The offline run's directory (what `wandb sync` takes), the run's URL online, None without W&B."""
    if logger.wandb is None:
        return None
    run = logger.wandb.run
    return str(Path(run.dir).parent) if run.offline else run.url


def describe(summary: RunSummary) -> str:
    first, total = summary.first_step, summary.total_steps
    if first < total:
        head = f"steps {first}-{total - 1} done, policy version {summary.policy_version}"
    else:
        head = f"all {total} steps were already done (raise total_steps to go on, or use another run_dir)"
    lines = [f"SpecRoll run in {summary.run_dir}: {head}"]
    if summary.wandb_dir:
        sync = f"   (upload: wandb sync {summary.wandb_dir})" if not summary.wandb_dir.startswith("http") else ""
        lines.append(f"  W&B run:      {summary.wandb_dir}{sync}")
    if summary.metrics_file:
        lines.append(f"  metrics:      {summary.metrics_file}")
    lines.append(f"  checkpoints:  {summary.checkpoint_dir}   (latest: {summary.last_checkpoint})")
    lines.append(f"  config:       {summary.config_file}")
    if summary.last_eval:
        lines.append(f"  evaluation:   {summary.last_eval}")
    if summary.curves_file:
        lines.append(f"  curves:       {summary.curves_file}")
    if summary.table:
        lines += ["", "Summary:", summary.table]
    return "\n".join(lines)
