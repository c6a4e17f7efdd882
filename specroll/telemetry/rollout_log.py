"""Every response of a run, one JSON line per step: `run_dir/rollouts.jsonl` (`logger.rollouts`).

What two runs sampled can then be compared token by token (`python -m specroll.tools.compare_runs`):
with coupled draws a speculative run's responses are the vanilla run's for the same seed. Like
`metrics.jsonl`, a resumed run first drops the lines of the steps it redoes.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from specroll.storage import write_atomically

from .sinks import lines_before

ROLLOUTS_NAME = "rollouts.jsonl"


@dataclass(frozen=True)
class StepRollouts:
    """One step's line: per prompt its index in the step's batch and tokens, per response (prompt-major)
    its tokens, reward and finish reason, and the policy version that sampled them."""

    step: int
    policy_version: int
    prompt_indices: list[int]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rewards: list[float]
    finish_reasons: list[str]


class RolloutLog:
    """Appends each step's `StepRollouts` to `path`, after dropping the lines of steps >= `first_step`."""

    def __init__(self, path: Path, first_step: int = 0) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            write_atomically(path, "".join(line + "\n" for line in lines_before(path, first_step)))
        self.file = path.open("a")

    def write(self, rollouts) -> None:
        """`rollouts`: an `actors.batch.Rollouts` (any object with its fields)."""
        line = StepRollouts(rollouts.step, rollouts.policy_version, list(rollouts.prompt_indices),
                            rollouts.prompt_ids, rollouts.response_ids, list(rollouts.rewards),
                            list(rollouts.finish_reasons))
        self.file.write(json.dumps(asdict(line)) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def read_rollouts(run_dir: str | Path) -> dict[int, StepRollouts]:
    """A run's logged responses by step (a last line cut short by a crash is left out)."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / ROLLOUTS_NAME
    if not path.exists():
        raise FileNotFoundError(f"no responses at {path}: a run logs them there with logger.rollouts=true")
    rows = (StepRollouts(**json.loads(line)) for line in lines_before(path, math.inf))
    return {row.step: row for row in rows}
