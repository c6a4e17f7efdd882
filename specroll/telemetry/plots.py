"""Figures of benchmark and run telemetry, shared by the notebooks and the benchmark commands.

Each `plot_*` function draws on its own `matplotlib.figure.Figure` (the Agg canvas, no pyplot),
so it works headless and never changes the backend of a notebook that imports it; it saves the
figure when given a path and returns it (a notebook shows a returned figure).

Runs (`runs`: run directories, {label: directory}, or `RunHistory`s; see `history.read_runs`):
`plot_run_curves` draws every panel of `RUN_PANELS` in one figure, `plot_run_panel` one of them.
Comparisons of rollout modes: `plot_tokens_per_pass` (also the adaptation benchmark's),
`plot_budget_trace`, `plot_speedup_by_concurrency`. Draft yield: `plot_yield_by_budget`. What runs
learned, side by side: `plot_learning_curves`.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from . import metric_names as m
from .history import RunHistory, read_runs
from .run_summary import acceptance_by_depth

Runs = Sequence[str | Path | RunHistory] | Mapping[str, str | Path] | str | Path | RunHistory


def plot_tokens_per_pass(series: Mapping[str, Sequence[float]], drift_at: int | None = None,
                         updates: Mapping[str, Sequence[int]] | None = None, path: str | Path | None = None,
                         title: str = "") -> Figure:
    """Tokens per verify pass over rounds (training steps), one line per drafting mode.

    series: mode -> value per round; drift_at: the first round of the drifted policy (a dashed
    line before it); updates: mode -> rounds that first drafted with newly committed heads (marked).
    """
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for mode, values in series.items():
        rounds = list(range(len(values)))
        (line,) = ax.plot(rounds, values, marker=".", label=mode)
        marked = [r for r in (updates or {}).get(mode, ()) if 0 <= r < len(values)]
        if marked:
            ax.scatter(marked, [values[r] for r in marked], s=80, facecolors="none", edgecolors=line.get_color())
    if drift_at is not None:
        ax.axvline(drift_at - 0.5, color="grey", linestyle="--", label="policy drift")
    if updates and any(updates.values()):
        ax.scatter([], [], s=80, facecolors="none", edgecolors="grey", label="new heads (committed update)")
    ax.set_xlabel("round (one training step)")
    ax.set_ylabel("tokens per verify pass")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    if title:
        ax.set_title(title, fontsize="medium")
    return saved(fig, path)


def plot_drift(rows: Sequence[Mapping], path: str | Path | None = None, title: str = "") -> Figure:
    """The drift curve: tokens per verify pass of frozen and retrained heads per policy snapshot
    (error bars: standard errors), and how far each snapshot moved (KL from the first)."""
    fig = Figure(figsize=(8, 6), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    x = list(range(len(rows)))
    for arm in ("frozen", "retrained"):
        if arm in rows[0]:
            top.errorbar(x, [r[arm]["tokens_per_pass"] for r in rows],
                         yerr=[r[arm]["tokens_per_pass_se"] for r in rows], marker="o", capsize=3, label=f"{arm} heads")
    top.set_ylabel("tokens per verify pass")
    top.grid(alpha=0.3)
    top.legend(fontsize="small")
    bottom.plot(x, [r["kl_from_first"] for r in rows], marker="o", color="grey")
    bottom.set_ylabel("KL from first (nats/token)")
    bottom.set_xticks(x, [Path(str(r["snapshot"])).name for r in rows], rotation=20, fontsize="small")
    bottom.grid(alpha=0.3)
    if title:
        top.set_title(title, fontsize="medium")
    return saved(fig, path)


def saved(fig: Figure, path: str | Path | None) -> Figure:
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig


# Run panels: each draws one aspect of the runs on `ax`, with the training step as x where it has one.

def no_data(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in these runs", ha="center", va="center", transform=ax.transAxes, color="grey")


def step_axis(ax: Axes) -> None:
    ax.set_xlabel("training step")
    ax.xaxis.get_major_locator().set_params(integer=True)


def label(run: RunHistory, runs: Sequence[RunHistory], what: str) -> str:
    return what if len(runs) == 1 else f"{run.name}: {what}"


def draw_lines(ax: Axes, runs: Sequence[RunHistory], names: Mapping[str, str], ylabel: str) -> None:
    """One line per (run, metric); `names`: metric -> legend text. Styles tell metrics apart, colours runs."""
    styles = ("-", "--", ":", "-.")
    drawn = False
    for i, run in enumerate(runs):
        for style, (name, what) in zip(styles, names.items()):
            steps, values = run.series(name)
            if steps:
                ax.plot(steps, values, style, marker=".", color=f"C{i}", label=label(run, runs, what))
                drawn = True
    step_axis(ax)
    ax.set_ylabel(ylabel)
    if drawn:
        ax.legend(fontsize="small")
    else:
        no_data(ax, " or ".join(names))


def draw_throughput(ax: Axes, runs: Sequence[RunHistory]) -> None:
    draw_lines(ax, runs, {m.GEN_TOKENS_PER_S: "generated", m.TRAIN_TOKENS_PER_S: "trained"}, "tokens/s")
    ax.set_title("throughput", fontsize="medium")


def draw_step_time(ax: Axes, runs: Sequence[RunHistory]) -> None:
    draw_lines(ax, runs, {m.STEP_TIME_S: "step", m.TIME_GEN: "generation"}, "seconds")
    ax.set_title("step time", fontsize="medium")


def draw_time_breakdown(ax: Axes, run: RunHistory) -> None:
    """The phases of each step stacked (timing_s/*), the whole step's wall time on top as a line.

    With cluster.overlap or an overlapping head update, phases run at once and the stack can exceed it.
    """
    steps = run.steps
    phases = {name: dict(zip(*run.series(name))) for name in m.family_names("timing_s")}
    phases = {name: [by_step.get(s, 0.0) for s in steps] for name, by_step in phases.items() if by_step}
    if not phases:
        no_data(ax, "timing_s/*")
    else:
        ax.stackplot(steps, *phases.values(), labels=[name.split("/", 1)[1] for name in phases], alpha=0.8)
        total_steps, total = run.series(m.STEP_TIME_S)
        if total_steps:
            ax.plot(total_steps, total, "k.-", label="whole step")
        ax.legend(fontsize="x-small", loc="upper left")
    step_axis(ax)
    ax.set_ylabel("seconds")
    ax.set_title(f"where the step's time goes: {run.name}", fontsize="medium")


def draw_tokens_per_pass(ax: Axes, runs: Sequence[RunHistory]) -> None:
    draw_lines(ax, runs, {m.TOKENS_PER_STEP: "tokens per verify pass"}, "tokens per verify pass")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_title("tokens per verify pass (1 = no gain)", fontsize="medium")


def draw_acceptance_by_depth(ax: Axes, runs: Sequence[RunHistory]) -> None:
    """Per run, the share accepted at each tree depth over the steps that drafted (as the run's summary)."""
    drawn = False
    for i, run in enumerate(runs):
        accepted = acceptance_by_depth(run)
        if any(a is not None for a in accepted):
            ax.plot(range(1, len(accepted) + 1), accepted, "o-", color=f"C{i}", label=run.name)
            drawn = True
    ax.set_xlabel("tree depth")
    ax.set_ylabel("accepted share (steps that drafted)")
    ax.set_ylim(0, 1.05)
    ax.set_title("acceptance by depth", fontsize="medium")
    if drawn:
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize="small")
    else:
        no_data(ax, "speculation/acceptance_depth_*")


def draw_budget_vs_active(ax: Axes, runs: Sequence[RunHistory]) -> None:
    """One point per step: mean nodes per response against mean unfinished responses."""
    drawn = False
    for i, run in enumerate(runs):
        rows = [r for r in run.rows if r.get(m.NODE_BUDGET_MEAN) is not None and r.get(m.ACTIVE_ROWS_MEAN) is not None]
        if rows:
            ax.scatter([r[m.ACTIVE_ROWS_MEAN] for r in rows], [r[m.NODE_BUDGET_MEAN] for r in rows],
                       color=f"C{i}", label=run.name)
            drawn = True
    ax.set_xlabel("active rows (mean per decode step)")
    ax.set_ylabel("node budget (mean per response)")
    ax.set_title("node budget against active rows", fontsize="medium")
    if drawn:
        ax.legend(fontsize="small")
    else:
        no_data(ax, m.NODE_BUDGET_MEAN)


def draw_heads(ax: Axes, runs: Sequence[RunHistory]) -> None:
    draw_lines(ax, runs, {m.HEAD_VERSION: "heads drafting", m.HEADS_VERSION: "heads published",
                          m.HEADS_UPDATES: "head updates"}, "version / count")
    ax.set_title("draft heads", fontsize="medium")


def draw_rewards(ax: Axes, runs: Sequence[RunHistory]) -> None:
    draw_lines(ax, runs, {m.REWARD_MEAN: "reward", m.ACCURACY: "accuracy"}, "mean over responses")
    ax.set_title("rewards", fontsize="medium")


def draw_held_out(ax: Axes, runs: Sequence[RunHistory]) -> None:
    """Greedy accuracy on the held-out problems against the updates behind the policy (run_dir/evals/);
    runs after the first dashed, so a twin that coincides stays visible."""
    for i, run in enumerate(runs):
        styles = dict(marker="o", color=f"C{i}") if i == 0 else dict(marker="x", linestyle="--", color=f"C{i}")
        ax.plot([u for u, _ in run.held_out], [a for _, a in run.held_out], label=run.name, **styles)
    step_axis(ax)
    ax.set_xlabel("policy updates")
    ax.set_ylabel("share of held-out problems solved (greedy)")
    ax.set_title("held-out accuracy", fontsize="medium")
    if any(run.held_out for run in runs):
        ax.legend(fontsize="small")
    else:
        no_data(ax, "held-out evaluations (eval_every)")


RUNS_PANELS: dict[str, Callable[[Axes, Sequence[RunHistory]], None]] = {  # every run on one axes
    "throughput": draw_throughput,
    "step_time": draw_step_time,
    "tokens_per_pass": draw_tokens_per_pass,
    "acceptance_by_depth": draw_acceptance_by_depth,
    "budget_vs_active": draw_budget_vs_active,
    "heads": draw_heads,
    "rewards": draw_rewards,
    "held_out": draw_held_out,
}
ONE_RUN_PANELS: dict[str, Callable[[Axes, RunHistory], None]] = {  # one axes per run
    "time_breakdown": draw_time_breakdown,
}
RUN_PANELS = ("throughput", "step_time", "time_breakdown", "tokens_per_pass", "acceptance_by_depth",
              "budget_vs_active", "heads", "rewards", "held_out")  # plot_run_curves' order


def panel_calls(runs: Sequence[RunHistory], panels: Sequence[str]) -> list[Callable[[Axes], None]]:
    """One drawing per axes."""
    calls: list[Callable[[Axes], None]] = []
    for panel in panels:
        if panel in ONE_RUN_PANELS:
            calls += [lambda ax, run=run, draw=ONE_RUN_PANELS[panel]: draw(ax, run) for run in runs]
        elif panel in RUNS_PANELS:
            calls.append(lambda ax, draw=RUNS_PANELS[panel]: draw(ax, runs))
        else:
            raise ValueError(f"unknown panel {panel!r}; panels: {', '.join(RUN_PANELS)}")
    return calls


def plot_run_panels(runs: Runs, panels: Sequence[str] = RUN_PANELS, path: str | Path | None = None,
                    columns: int = 2) -> Figure:
    """The chosen `RUN_PANELS` of the runs in a grid of `columns`."""
    histories = read_runs(runs)
    if not histories:
        raise ValueError("no runs to plot")
    calls = panel_calls(histories, panels)
    columns = min(columns, len(calls))
    rows = math.ceil(len(calls) / columns)
    fig = Figure(figsize=(6.5 * columns, 4 * rows), layout="constrained")
    for i, draw in enumerate(calls):
        ax = fig.add_subplot(rows, columns, i + 1)
        ax.grid(alpha=0.3)
        draw(ax)
    return saved(fig, path)


def plot_run_curves(runs: Runs, path: str | Path | None = None) -> Figure:
    """Everything a user looks at after a run, one panel each: throughput, step time, where the
    step's time goes, tokens per verify pass, acceptance by depth, node budget against active
    rows, draft-head versions and updates, rewards and accuracy, held-out accuracy."""
    return plot_run_panels(runs, RUN_PANELS, path)


def plot_run_panel(runs: Runs, panel: str, path: str | Path | None = None) -> Figure:
    """One of `RUN_PANELS` (the step-time breakdown: one axes per run)."""
    return plot_run_panels(runs, (panel,), path)


# Comparison figures: rollout modes raced on the same prompts (see specroll/benchmarks/comparison_record.py).

class Trace(Protocol):
    active_rows: Sequence[int]
    node_budget: Sequence[int]


def plot_budget_trace(traces: Mapping[str, Trace], path: str | Path | None = None, title: str = "") -> Figure:
    """Within one rollout, per mode: active rows and node budget over decode steps, and the budget
    against the active rows (how the tree budget follows the unfinished responses)."""
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    over_time, against = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    rows_axis = over_time.twinx()
    for i, (mode, trace) in enumerate(traces.items()):
        decode_steps = range(len(trace.node_budget))
        over_time.plot(decode_steps, trace.node_budget, "-", color=f"C{i}", label=f"{mode}: node budget")
        rows_axis.plot(decode_steps, trace.active_rows, ":", color=f"C{i}", label=f"{mode}: active rows")
        against.scatter(trace.active_rows, trace.node_budget, s=12, color=f"C{i}", alpha=0.6, label=mode)
    over_time.set_xlabel("decode step (verify pass) of the rollout")
    over_time.set_ylabel("node budget (nodes per response, solid)")
    rows_axis.set_ylabel("active rows (dotted)")
    against.set_xlabel("active rows")
    against.set_ylabel("node budget (nodes per response)")
    for ax in (over_time, against):
        ax.grid(alpha=0.3)
    if traces:
        handles = [h for ax in (over_time, rows_axis) for h in ax.get_legend_handles_labels()[0]]
        over_time.legend(handles=handles, fontsize="small")
        against.legend(fontsize="small")
    else:
        no_data(over_time, "rollout traces")
    if title:
        fig.suptitle(title, fontsize="medium")
    return saved(fig, path)


def plot_speedup_by_concurrency(speedups: Mapping[str, Sequence[tuple[int, float]]], path: str | Path | None = None,
                                title: str = "") -> Figure:
    """Generation speedup over vanilla decoding against concurrency (responses decoded at once), per mode."""
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for mode, points in speedups.items():
        ax.plot([c for c, _ in points], [s for _, s in points], "o-", label=mode)
    ax.axhline(1.0, color="grey", linestyle="--", label="vanilla")
    ax.set_xscale("log", base=2)
    measured = sorted({c for points in speedups.values() for c, _ in points})
    if measured:
        ax.set_xticks(measured, [str(c) for c in measured])
        ax.minorticks_off()
    ax.set_xlabel("concurrency (responses decoded at once)")
    ax.set_ylabel("speedup over vanilla (tokens/s ratio)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    if not speedups:
        no_data(ax, "concurrency measurements")
    if title:
        ax.set_title(title, fontsize="medium")
    return saved(fig, path)


def plot_yield_by_budget(sources: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]],
                         oracle: Mapping[str, Sequence[tuple[int, float]]], path: str | Path | None = None,
                         title: str = "") -> Figure:
    """Tokens per verify pass against the node budget, one panel per sampling setting: a line per
    draft source and the oracle bound at the same budgets (dashed).

    sources: setting -> source -> (nodes per response, tokens per pass); oracle: setting -> the same points."""
    settings = list(sources) or [""]
    fig = Figure(figsize=(5.5 * len(settings), 4.5), layout="constrained")
    axes = fig.subplots(1, len(settings), sharey=True, squeeze=False)[0]
    for ax, setting in zip(axes, settings):
        for name, points in sources.get(setting, {}).items():
            ax.plot([b for b, _ in points], [t for _, t in points], "o-", label=name)
        bound = oracle.get(setting, ())
        if bound:
            ax.plot([b for b, _ in bound], [t for _, t in bound], "k--", marker="x", label="oracle bound")
        budgets = sorted({b for points in sources.get(setting, {}).values() for b, _ in points})
        if budgets:
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.minorticks_off()
            ax.legend(fontsize="small")
        else:
            no_data(ax, "yield measurements")
        ax.set_xlabel("node budget (nodes per response, root included)")
        ax.set_title(setting, fontsize="medium")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tokens per verify pass")
    if title:
        fig.suptitle(title, fontsize="medium")
    return saved(fig, path)


def plot_learning_curves(runs: Mapping[str, str | Path], path: str | Path | None = None, title: str = "") -> Figure:
    """What a run learned, runs side by side: the rollouts' reward and accuracy per step, and the
    greedy accuracy on held-out problems against the updates behind the policy (run_dir/evals/)."""
    histories = read_runs(runs)
    fig = Figure(figsize=(13, 4.5), layout="constrained")
    rewards, held_out = fig.subplots(1, 2)
    draw_rewards(rewards, histories)
    draw_held_out(held_out, histories)
    for ax in (rewards, held_out):
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize="medium")
    return saved(fig, path)
