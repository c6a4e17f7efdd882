"""Where a step's metrics go: a W&B run, a JSONL file in the run directory, a console line.

`MetricsLogger` checks every name against the namespace (`metric_names`) and every value
(a real number), then fans the step out to the sinks the `LoggerConfig` enables.
"""
from __future__ import annotations

import json
import math
import numbers
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from tqdm.auto import tqdm

from specroll.storage import write_atomically

from .config import LoggerConfig
from .metric_names import FAMILIES, STEP, check_metric_name
from .wandb_branch import branch_notes, branch_to_keep, keep_branch, read_branch, run_to_continue

JSONL_NAME = "metrics.jsonl"


def clean_metrics(metrics: Mapping[str, Any]) -> dict[str, float | int]:
    """Names checked against the namespace; values as Python numbers (tensors, numpy scalars too)."""
    out: dict[str, float | int] = {}
    for name, value in metrics.items():
        check_metric_name(name)
        if getattr(value, "ndim", None) == 0:
            value = value.item()  # torch and numpy scalars
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"metric {name!r} must be a real number, got {value!r}")
        out[name] = int(value) if isinstance(value, numbers.Integral) else float(value)
    return out


def lines_before(path: Path, first_step: int) -> list[str]:
    """The lines of `path` for steps before `first_step`; a last line cut short by a crash is dropped."""
    lines = path.read_text().splitlines()
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number} is not a JSON line: {line[:80]!r}") from None
        if row["step"] < first_step:
            kept.append(line)
    return kept


def history_before(path: Path, first_step: int) -> list[tuple[int, dict[str, float | int]]]:
    """(step, metrics) of each line of `path` before `first_step`, nulls back to NaN; none without the file."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in lines_before(path, first_step)]
    return [(row.pop("step"), {k: math.nan if v is None else v for k, v in row.items()}) for row in rows]


def missing_steps(lines: list[str], first_step: int) -> list[int]:
    """Steps before `first_step` that no line of `lines` (a metrics file's, in order) records."""
    present = {json.loads(line)["step"] for line in lines}
    return [step for step in range(first_step) if step not in present]


def step_ranges(steps: list[int]) -> str:
    """[0, 1, 2, 5] as "0-2, 5"."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][-1] + 1:
            runs[-1].append(step)
        else:
            runs.append([step])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


class JsonlSink:
    """One line per step, `{"step": ..., <metrics>}`; non-finite values are written as null.

    Lines of steps at or after `first_step` are dropped when the file is opened: a run
    resumed from a checkpoint redoes those steps (or, after a rollback, takes them on a new
    branch) and must not record them twice. Steps before it without a line (a run that lost
    them, or logged none) are warned about once and left as a gap: nothing can fill them in.
    """

    def __init__(self, path: Path, first_step: int = 0) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = lines_before(path, first_step) if path.exists() else []
        if path.exists():
            write_atomically(path, "".join(line + "\n" for line in kept))
        missing = missing_steps(kept, first_step)
        if missing:
            warnings.warn(f"{path} has no line for step(s) {step_ranges(missing)} of the {first_step} before the "
                          "resumed checkpoint: they stay a gap", stacklevel=2)
        self.file = path.open("a")

    def log(self, step: int, metrics: dict[str, float | int]) -> None:
        row = {"step": step, **{k: v if math.isfinite(v) else None for k, v in metrics.items()}}
        self.file.write(json.dumps(row, allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class ConsoleSink:
    """`step 12 | perf/step_time_s=4.21 | rollout/reward_mean=0.5 | ...`, printed above any progress bar."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream

    def log(self, step: int, metrics: dict[str, float | int]) -> None:
        fields = " | ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))
        tqdm.write(f"step {step} | {fields}", file=self.stream or sys.stdout)

    def close(self) -> None:
        pass


class WandbSink:
    """A W&B run in `run_dir/wandb`; passing a saved `run_id` continues that run.

    Every family is defined against `train/step`, logged with each step, so W&B's charts (and
    the dashboard's, `telemetry.dashboard`) draw metrics against the training step.
    """

    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: dict | None, run_id: str | None,
                 notes: str | None = None) -> None:
        import wandb

        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.run_name,
            notes=notes,
            mode=cfg.mode,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=config,
        )
        self.run.define_metric(STEP)
        for family in FAMILIES:
            self.run.define_metric(f"{family}/*", step_metric=STEP)

    @property
    def run_id(self) -> str:
        return self.run.id

    def log(self, step: int, metrics: dict[str, float | int]) -> None:
        self.run.log({**metrics, STEP: step}, step=step)

    def close(self) -> None:
        self.run.finish()


def open_wandb(cfg: LoggerConfig, run_dir: Path, config: dict | None, continued: str | None,
               saved_run_id: str | None, first_step: int) -> WandbSink:
    """The W&B run `continued` names, or a new one given the steps before `first_step` from metrics.jsonl."""
    if continued is not None:
        return WandbSink(cfg, run_dir, config, continued)
    history = history_before(run_dir / JSONL_NAME, first_step)
    sink = WandbSink(cfg, run_dir, config, None, branch_notes(saved_run_id, first_step, replayed=bool(history)))
    for step, metrics in history:
        sink.log(step, metrics)
    return sink


class MetricsLogger:
    """Fans each step's metrics out to W&B, `run_dir/metrics.jsonl` and the console.

    W&B continues the run `run_id` names, except on a new branch (`wandb_branch`): there a new
    run starts with the steps before `first_step` replayed from metrics.jsonl, so that it holds
    each step of the live branch once.

    Args:
        cfg: which sinks, and the W&B settings.
        run_dir: the run directory (created if missing).
        config: the run's resolved config, recorded by W&B.
        run_id: the W&B run id saved in the checkpoint being resumed; None starts a new run.
        first_step: the first step this process logs (the resumed step + 1, or 0).
        console: stream of the console line; None is stdout.
    """

    def __init__(
        self,
        cfg: LoggerConfig,
        run_dir: str | Path,
        config: dict | None = None,
        run_id: str | None = None,
        first_step: int = 0,
        console: TextIO | None = None,
    ) -> None:
        run_dir = Path(run_dir)
        continued = run_to_continue(run_id, first_step, read_branch(run_dir))
        self.wandb = open_wandb(cfg, run_dir, config, continued, run_id, first_step) if cfg.uses_wandb else None
        self.sinks: list[Any] = [s for s in (self.wandb,) if s is not None]
        if cfg.jsonl:
            self.sinks.append(JsonlSink(run_dir / JSONL_NAME, first_step))
        if cfg.console:
            self.sinks.append(ConsoleSink(console))
        self._run_id = continued
        self.last_step = first_step - 1
        keep_branch(run_dir, branch_to_keep(run_id, first_step, self.run_id))

    @property
    def run_id(self) -> str | None:
        """The W&B run id to store in checkpoints (while W&B is off: the one given, None on a new branch)."""
        return self.wandb.run_id if self.wandb is not None else self._run_id

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record one step; steps must increase (W&B silently drops a step it has passed)."""
        if step <= self.last_step:
            raise ValueError(f"step {step} was logged after step {self.last_step}; steps must increase")
        clean = clean_metrics(metrics)
        for sink in self.sinks:
            sink.log(step, clean)
        self.last_step = step

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
