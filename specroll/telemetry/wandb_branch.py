"""Which W&B run a launch logs into, so that the run shows each step of the live branch once.

A resume continues the W&B run its checkpoint names. After a rollback (`resume=<older
checkpoint>`, which sets the newer ones aside) that run holds the abandoned history past the
checkpoint, and W&B keeps the first value it is given for a step: the branch gets a W&B run of
its own instead, and the steps before the checkpoint are replayed into it from metrics.jsonl,
which holds exactly the live branch's. W&B's own `fork_from` and `resume_from` (rewind) would
copy them server-side, but both are previews that self-managed servers lack, and offline they
only record the branch point for `wandb sync` to apply once the run branched from is uploaded.
A plain resume redoes the steps logged after its checkpoint; its W&B run keeps their first
values (a new run at every crash would scatter one run over many).

Until the branch's first checkpoint names its run, `run_dir/wandb_branch.json` does: written as
the rollback sets checkpoints aside, so that a launch failing before that checkpoint, and its
rerun, continue the branch's run and not the abandoned one.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from specroll.storage import write_atomically

BRANCH_NAME = "wandb_branch.json"  # under run_dir


@dataclass(frozen=True)
class WandbBranch:
    """The W&B run of a branch whose checkpoints do not name it yet."""

    first_step: int | None  # the step the branch resumes at; None until a launch resumed it
    run_id: str | None  # None until a launch with W&B on started the branch's run


def run_to_continue(saved_run_id: str | None, first_step: int, branch: WandbBranch | None) -> str | None:
    """The W&B run a launch resuming at `first_step` logs into; None starts a new one.

    The branch's run while the launch resumes where the branch began (a new one until there is
    one), else the run the resumed checkpoint names (None after a launch without W&B)."""
    if branch is not None and branch.first_step in (None, first_step):
        return branch.run_id
    return saved_run_id


def branch_to_keep(saved_run_id: str | None, first_step: int, run_id: str | None) -> WandbBranch | None:
    """What `wandb_branch.json` holds once a launch resuming at `first_step` logs into `run_id`: that
    run, when no checkpoint names it yet (it is not the one the resumed checkpoint saved)."""
    return WandbBranch(first_step, run_id) if first_step > 0 and run_id != saved_run_id else None


def branch_notes(saved_run_id: str | None, first_step: int, replayed: bool) -> str | None:
    """The notes of a W&B run started at `first_step`: where its earlier steps, and the run left behind, are."""
    notes = [f"steps 0-{first_step - 1} replayed from metrics.jsonl"] if replayed else []
    if saved_run_id is not None:
        notes.append(f"branched at step {first_step} from W&B run {saved_run_id}, which keeps the abandoned history")
    return "; ".join(notes) or None


def start_wandb_branch(run_dir: Path) -> None:
    """Mark a rollback: the next launch logs into a new W&B run, not the run its checkpoint names."""
    keep_branch(run_dir, WandbBranch(first_step=None, run_id=None))


def read_branch(run_dir: Path) -> WandbBranch | None:
    path = run_dir / BRANCH_NAME
    return WandbBranch(**json.loads(path.read_text())) if path.exists() else None


def keep_branch(run_dir: Path, branch: WandbBranch | None) -> None:
    """Write `branch` to `run_dir/wandb_branch.json`, or remove the file when None."""
    path = run_dir / BRANCH_NAME
    if branch is None:
        path.unlink(missing_ok=True)
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(asdict(branch)) + "\n")
