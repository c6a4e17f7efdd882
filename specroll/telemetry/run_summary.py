"""The table a run prints at its end: did it speculate, did it learn, where did the time go.

Pure functions of the run's logged rows (`RunHistory.rows`, one per training step).
"""
from __future__ import annotations

from collections.abc import Sequence

from . import metric_names as m
from .history import RunHistory

# Phases of a step in the order they happen; the rest of the step is the driver's own work.
PHASES = (m.TIME_WEIGHT_SYNC, m.TIME_GEN, m.TIME_REWARD, m.TIME_RESAMPLE, m.TIME_OLD_LOGPROB, m.TIME_UPDATE,
          m.TIME_CHECKPOINT, m.TIME_EVAL)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def first_and_last(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Means of the first and the last quarter of the steps (at least one step each)."""
    k = max(1, len(values) // 4)
    return mean(values[:k]), mean(values[-k:])


def weighted_mean(run: RunHistory, name: str, weight: str) -> float | None:
    """Mean of `name` over the steps, each weighted by `weight` (steps without either are left out)."""
    pairs = [(row[name], row[weight]) for row in run.rows if row.get(name) is not None and row.get(weight)]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else None


def acceptance_by_depth(run: RunHistory) -> list[float | None]:
    """Share accepted at tree depth 1, 2, ... over the steps that drafted, weighted by verify passes
    (steps that decoded plain report zero at every depth: they are left out)."""
    drafting = RunHistory(run.name, [row for row in run.rows if row.get(m.DRAFTED_TOKENS_PER_STEP) is not None])
    depths = sorted((n for n in drafting.names() if n.startswith("speculation/acceptance_depth_")),
                    key=lambda n: int(n.rsplit("_", 1)[1]))
    return [weighted_mean(drafting, n, m.VERIFY_STEPS) for n in depths]


def time_shares(run: RunHistory) -> dict[str, float]:
    """Share of the run's summed step time spent in each phase, plus `other` for the rest."""
    total = sum(run.series(m.STEP_TIME_S)[1])
    if total <= 0:
        return {}
    shares = {name: sum(run.series(name)[1]) / total for name in PHASES}
    shares = {name: share for name, share in shares.items() if share > 0}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


def would_be_line(run: RunHistory) -> str | None:
    """What trees would have carried where the budget decoded plain, and what made it choose plain
    (None: no would-be tree was scored)."""
    carried = weighted_mean(run, m.WOULD_BE_TOKENS_PER_STEP, m.WOULD_BE_PASSES)
    if carried is None:
        return None
    nodes = max(run.series(m.WOULD_BE_NODES)[1], default=0)
    cost = weighted_mean(run, m.TREE_STEP_COST, m.WOULD_BE_PASSES)
    why = ("plain chosen by the budget policy" if cost is None
           else f"plain chosen: a tree step costs {cost:.1f} plain steps on this machine")
    return f"trees would carry {carried:.2f} tokens per verify pass (would-be, {nodes:.0f} nodes); {why}"


def summary_rows(run: RunHistory) -> list[tuple[str, str]]:
    """(what, value) lines of the end-of-run table; held-out accuracy from the run's evaluations as
    written to evals/, the one before training included (without them the `eval/*` metrics give the row)."""
    def fmt(value: float | None, spec: str = ".2f") -> str:
        return "-" if value is None else format(value, spec)

    rows = []
    drafted = weighted_mean(run, m.DRAFTED_TOKENS_PER_STEP, m.VERIFY_STEPS)
    if run.series(m.VERIFY_STEPS)[1]:
        overall = weighted_mean(run, m.TOKENS_PER_STEP, m.VERIFY_STEPS)
        rows.append(("tokens per verify pass", f"{fmt(drafted)} where a tree was drafted, {fmt(overall)} overall"))
        rows.append(("acceptance by depth", " ".join(fmt(a) for a in acceptance_by_depth(run)) or "-"))
        rows.append(("mean tree nodes per response", fmt(mean(run.series(m.NODE_BUDGET_MEAN)[1]), ".1f")))
        if (line := would_be_line(run)) is not None:
            rows.append(("while decoding plain", line))
    rows.append(("generation tokens/s", fmt(mean(run.series(m.GEN_TOKENS_PER_S)[1]), ".1f")))
    for name, what in ((m.REWARD_MEAN, "reward mean"), (m.ACCURACY, "accuracy")):
        values = run.series(name)[1]
        if values:
            first, last = first_and_last(values)
            rows.append((f"{what}, first -> last steps", f"{fmt(first)} -> {fmt(last)}"))
    if run.held_out:
        (first_updates, first), (last_updates, last) = run.held_out[0], run.held_out[-1]
        rows.append(("held-out accuracy, first -> last eval",
                     f"{fmt(first)} -> {fmt(last)} (after {first_updates} -> {last_updates} updates)"))
    elif accuracy := run.series(m.EVAL_ACCURACY)[1]:
        rows.append(("held-out accuracy, first -> last eval", f"{fmt(accuracy[0])} -> {fmt(accuracy[-1])}"))
    zero_std = run.series(m.FRAC_ZERO_STD_GROUPS)[1]
    if zero_std:
        rows.append(("groups with no reward signal", fmt(mean(zero_std), ".0%")))
    step_time = run.series(m.STEP_TIME_S)[1]
    rows.append(("step time, s (mean)", fmt(mean(step_time), ".1f")))
    shares = time_shares(run)
    if shares:
        rows.append(("where the step's time went",
                     ", ".join(f"{name.removeprefix('timing_s/')} {share:.0%}" for name, share in shares.items())))
    return rows


def format_summary(run: RunHistory) -> str:
    rows = summary_rows(run)
    width = max(len(what) for what, _ in rows)
    return "\n".join(f"  {what:<{width}}  {value}" for what, value in rows)
