"""Figures of benchmark and run telemetry, one function per kind of figure.

Each function draws on its own `matplotlib.figure.Figure` (the Agg canvas, no pyplot), so it
works headless and never changes the backend of a notebook that imports it; it saves the
figure when given a path and returns it.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.figure import Figure


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
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig
