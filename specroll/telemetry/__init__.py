"""Metric names (a stable namespace), sinks (W&B, JSONL, console), progress display."""
from . import metric_names
from .metric_names import acceptance_depth, check_metric_name, is_metric_name
from .progress import StepProgress, step_summary
from .rollout_stats import drafter_update_metrics, response_metrics, summarize_rollout_stats
from .sinks import ConsoleSink, JsonlSink, MetricsLogger, WandbSink, clean_metrics
from .wandb_branch import start_wandb_branch

__all__ = [
    "ConsoleSink",
    "JsonlSink",
    "MetricsLogger",
    "StepProgress",
    "WandbSink",
    "acceptance_depth",
    "check_metric_name",
    "clean_metrics",
    "drafter_update_metrics",
    "is_metric_name",
    "metric_names",
    "response_metrics",
    "start_wandb_branch",
    "step_summary",
    "summarize_rollout_stats",
]
