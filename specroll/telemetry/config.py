"""Where a run's metrics go: the `logger` section of its config (`conf/logger/`)."""
from __future__ import annotations

from dataclasses import dataclass

from specroll.config_checks import check_choice, check_text

LOGGER_BACKENDS = ("wandb", "none")
WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class LoggerConfig:
    """Where metrics go: W&B, a JSONL file in the run directory, the console."""

    backend: str = "wandb"  # wandb or none
    mode: str = "offline"  # W&B mode: offline (files in run_dir/wandb, sync later), online or disabled
    project: str = "specroll"  # W&B project
    entity: str | None = None  # W&B team or user; null = the default of the logged-in account
    run_name: str | None = None  # W&B display name; null lets W&B pick one
    jsonl: bool = True  # append one JSON line per step to run_dir/metrics.jsonl
    console: bool = True  # print one line of metrics per step
    rollouts: bool = False  # append each step's responses (token ids, rewards) to run_dir/rollouts.jsonl

    def __post_init__(self) -> None:
        check_choice("backend", self.backend, LOGGER_BACKENDS)
        check_choice("mode", self.mode, WANDB_MODES)
        check_text("project", self.project)

    @property
    def uses_wandb(self) -> bool:
        return self.backend == "wandb" and self.mode != "disabled"
