"""A console progress bar over training steps with a one-glance summary of the latest step."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TextIO

from tqdm.auto import tqdm

from . import metric_names as m


def step_summary(metrics: Mapping[str, float]) -> str:
    """`reward 0.53 | 1.2e+03 tok/s | 4.2 s/step`, leaving out what the step did not report."""
    parts = []
    if m.REWARD_MEAN in metrics:
        parts.append(f"reward {metrics[m.REWARD_MEAN]:.3g}")
    if m.GEN_TOKENS_PER_S in metrics:
        parts.append(f"{metrics[m.GEN_TOKENS_PER_S]:.3g} tok/s")
    if m.STEP_TIME_S in metrics:
        parts.append(f"{metrics[m.STEP_TIME_S]:.3g} s/step")
    return " | ".join(parts)


class StepProgress:
    """tqdm bar from `first_step` to `total_steps`; `update` after each finished step.

    `enabled=None` shows the bar only on a terminal (tqdm's rule), so logs stay clean.
    """

    def __init__(self, total_steps: int, first_step: int = 0, enabled: bool | None = None,
                 stream: TextIO | None = None) -> None:
        self.bar = tqdm(total=total_steps, initial=first_step, desc="train", unit="step",
                        disable=None if enabled is None else not enabled, file=stream, dynamic_ncols=True,
                        mininterval=0)  # steps take seconds: redraw on every update

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        """Mark `step` (0-based) finished and show its summary."""
        self.bar.set_postfix_str(step_summary(metrics), refresh=False)
        self.bar.update(step + 1 - self.bar.n)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> "StepProgress":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
