"""The comparison of rollout modes as a typed record: what `specroll.benchmarks.compare --json` writes.

Schema 1 (a JSON object):

    schema       1
    settings     free-form: policy, heads, dataset, steps, seed, ... (recorded, not plotted)
    modes        one `ModeRun` per (race, mode), vanilla first in each race:
                   race        the conditions the modes share (policy, dataset); one set of plots each
                   name        unique within the race: "vanilla", "fastgrpo", "speculation-<adaptation>"
                   rollout     "vanilla" | "fastgrpo" | "speculation"
                   adaptation  rollout.speculation.adaptation of a speculation mode, else null
                   steps       the training steps' metrics as logged: metrics.jsonl rows
                               ({"step": 0, "<name from metric_names>": value or null, ...})
                   trace       one rollout decode step by decode step, or null (vanilla):
                               {"active_rows": [...], "node_budget": [...]} (nodes per response)
                   summary     the table's figures (free-form; e.g. gen_s, step_s,
                               gen_speedup_vs_vanilla = vanilla's seconds / this mode's)
    concurrency  `ConcurrencyPoint`s: {race, mode, concurrency, speedup (generation tokens/s over
                 vanilla's at that concurrency, measured side by side), tokens_per_pass or null}
    paper        free-form rows of the paper's GPU figures (for the table)
    table        the markdown table, or null

`load_comparison` checks the schema version, every metric name and the trace lengths.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..telemetry.history import RunHistory, check_rows

SCHEMA_VERSION = 1
ROLLOUT_MODES = ("vanilla", "fastgrpo", "speculation")


@dataclass(frozen=True)
class RolloutTrace:
    """One rollout, one entry per decode step: unfinished responses and tree nodes per response."""

    active_rows: list[int]
    node_budget: list[int]

    def __post_init__(self) -> None:
        if len(self.active_rows) != len(self.node_budget):
            raise ValueError(f"trace: {len(self.active_rows)} active_rows but {len(self.node_budget)} node_budget entries")


@dataclass(frozen=True)
class ModeRun:
    """One rollout mode's training steps in one race."""

    race: str
    name: str
    rollout: str
    steps: list[dict[str, float | int | None]]
    adaptation: str | None = None
    trace: RolloutTrace | None = None
    summary: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rollout not in ROLLOUT_MODES:
            raise ValueError(f"mode {self.name!r}: rollout must be one of {ROLLOUT_MODES}, got {self.rollout!r}")
        check_rows(self.steps, f"mode {self.name!r}")

    def history(self) -> RunHistory:
        """The steps as a run history, for the run-report figures."""
        return RunHistory(self.name, self.steps)


@dataclass(frozen=True)
class ConcurrencyPoint:
    race: str
    mode: str
    concurrency: int
    speedup: float  # generation tokens/s over vanilla's at this concurrency
    tokens_per_pass: float | None = None


@dataclass(frozen=True)
class Comparison:
    modes: list[ModeRun]
    concurrency: list[ConcurrencyPoint] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    paper: list[dict[str, Any]] = field(default_factory=list)
    table: str | None = None

    def __post_init__(self) -> None:
        seen = set()
        for mode in self.modes:
            if (mode.race, mode.name) in seen:
                raise ValueError(f"mode {mode.name!r} appears twice in race {mode.race!r}")
            seen.add((mode.race, mode.name))

    def races(self) -> list[str]:
        """Race labels in the order they first appear."""
        return list(dict.fromkeys(mode.race for mode in self.modes))

    def modes_of(self, race: str) -> list[ModeRun]:
        return [mode for mode in self.modes if mode.race == race]

    def series(self, race: str, name: str) -> dict[str, list[float]]:
        """mode -> the metric `name` over the race's steps (modes that never logged it left out)."""
        out = {}
        for mode in self.modes_of(race):
            _, values = mode.history().series(name)
            if values:
                out[mode.name] = values
        return out

    def traces(self, race: str) -> dict[str, RolloutTrace]:
        return {mode.name: mode.trace for mode in self.modes_of(race) if mode.trace is not None}

    def speedups(self, race: str) -> dict[str, list[tuple[int, float]]]:
        """mode -> (concurrency, speedup) pairs, by increasing concurrency."""
        out: dict[str, list[tuple[int, float]]] = {}
        for point in sorted(self.concurrency, key=lambda p: p.concurrency):
            if point.race == race:
                out.setdefault(point.mode, []).append((point.concurrency, point.speedup))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA_VERSION, **asdict(self)}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n")
        return path


def comparison_from_dict(data: dict[str, Any]) -> Comparison:
    if data.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"comparison schema {data.get('schema')!r} is not {SCHEMA_VERSION}, the one this loader reads")
    modes = []
    for raw in data["modes"]:
        raw = dict(raw)
        trace = raw.pop("trace", None)
        modes.append(ModeRun(**raw, trace=RolloutTrace(**trace) if trace is not None else None))
    return Comparison(
        modes=modes,
        concurrency=[ConcurrencyPoint(**p) for p in data.get("concurrency", [])],
        settings=data.get("settings", {}),
        paper=data.get("paper", []),
        table=data.get("table"),
    )


def load_comparison(path: str | Path) -> Comparison:
    """The comparison JSON at `path`, checked (schema version, metric names, trace lengths)."""
    path = Path(path)
    try:
        return comparison_from_dict(json.loads(path.read_text()))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not a comparison of schema {SCHEMA_VERSION}: {exc}") from exc
