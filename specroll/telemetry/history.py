"""A run's logged metrics read back: `run_dir/metrics.jsonl`, one row per training step, and its
held-out evaluations (`run_dir/evals/`).

    runs = read_runs(["runs/quickstart", "runs/vanilla"])
    steps, values = runs[0].series(metric_names.STEP_TIME_S)

The JSONL sink writes every step the W&B run gets (non-finite values as null), so this is
all the figures need; the W&B offline run in `run_dir/wandb` is the same data for `wandb sync`.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .metric_names import EVAL_ACCURACY, check_metric_name, current_name
from .sinks import JSONL_NAME, lines_before

STEP_KEY = "step"  # each row's training step (the JSONL sink's key, not a metric)


def check_rows(rows: Sequence[Mapping], where: str) -> None:
    """Rows hold an increasing `step` and metrics of the namespace only."""
    last = None
    for row in rows:
        step = row.get(STEP_KEY)
        if not isinstance(step, int) or (last is not None and step <= last):
            raise ValueError(f"{where}: steps must be increasing ints, got {step!r} after {last!r}")
        last = step
        for name in row:
            if name != STEP_KEY:
                check_metric_name(name)


@dataclass(frozen=True)
class RunHistory:
    """One run's metrics per step; `name` labels it in legends."""

    name: str
    rows: list[dict[str, float | int | None]]
    # (updates behind the policy, greedy accuracy) of each held-out evaluation, the one before training included
    held_out: list[tuple[int, float]] = field(default_factory=list)

    @property
    def steps(self) -> list[int]:
        return [row[STEP_KEY] for row in self.rows]

    def names(self) -> set[str]:
        """Every metric logged at some step."""
        return {name for row in self.rows for name, value in row.items() if name != STEP_KEY and value is not None}

    def series(self, name: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the steps that logged `name` with a finite value."""
        check_metric_name(name)
        pairs = [(row[STEP_KEY], row[name]) for row in self.rows if row.get(name) is not None]
        return [s for s, _ in pairs], [float(v) for _, v in pairs]


def read_run(run_dir: str | Path, name: str | None = None) -> RunHistory:
    """The history in `run_dir/metrics.jsonl` (or the JSONL file itself) with the held-out evaluations
    of `run_dir/evals/`; `name` defaults to the directory's.

    A last line cut short by a crash is left out (the sink drops it too when the run resumes).
    Metrics logged under a family renamed since (`metric_names.RENAMED_FAMILIES`) read under today's names.
    """
    path = Path(run_dir)
    if path.is_dir():
        path = path / JSONL_NAME
    if not path.exists():
        raise FileNotFoundError(f"no metrics at {path}: the run logs them there while logger.jsonl is true")
    rows = [{current_name(key): value for key, value in json.loads(line).items()}
            for line in lines_before(path, math.inf)]
    check_rows(rows, str(path))
    label = name or (path.parent.name if path.name == JSONL_NAME else path.stem)
    return RunHistory(label, rows, held_out_curve(path.parent) if path.name == JSONL_NAME else [])


def read_runs(runs: Iterable[str | Path | RunHistory] | Mapping[str, str | Path]) -> list[RunHistory]:
    """Histories of several runs: directories (labelled by name), {label: directory}, or histories as they are."""
    if isinstance(runs, Mapping):
        return [read_run(path, name) for name, path in runs.items()]
    if isinstance(runs, (str, Path, RunHistory)):
        runs = [runs]
    return [run if isinstance(run, RunHistory) else read_run(run) for run in runs]


EVALS = "evals"  # under run_dir: step_XXXXXXXX.json, the policy after that many updates (0: before training)


def eval_file(run_dir: str | Path, updates: int) -> Path:
    return Path(run_dir) / EVALS / f"step_{updates:08d}.json"


def held_out_curve(run_dir: str | Path) -> list[tuple[int, float]]:
    """(updates behind the policy, greedy accuracy) of each evaluation a run wrote, in order."""
    curve = []
    for path in sorted((Path(run_dir) / EVALS).glob("step_*.json")):
        evaluation = json.loads(path.read_text())
        curve.append((evaluation["step"], evaluation["metrics"][EVAL_ACCURACY]))
    return curve
