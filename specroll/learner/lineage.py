"""The checkpoints of a run directory as one line of history: listing, branching and pruning.

`root` holds `step_XXXXXXXX/` checkpoints of a single lineage: each one continues from the one
before it. Resuming from an older checkpoint (a rollback) starts a new branch: the checkpoints
of the abandoned history are moved to `root/abandoned/<time>-<first one moved>-*/`, never
deleted, and never found by `latest_checkpoint` (so `resume=auto` cannot return to them), and
pruning keeps the newest of the live lineage.
"""
from __future__ import annotations

import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path

from specroll.storage import fsync_directory

COMPLETE_MARKER = "COMPLETE"
CHECKPOINT_NAME = re.compile(r"^step_(\d{8})$")
ABANDONED = "abandoned"  # under the checkpoints directory: the histories rollbacks left behind
# With one kept, a newest checkpoint found damaged (or cut by a power loss) leaves nothing to resume from.
MIN_KEEP_LAST = 2


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def checkpoint_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint directory under `root`, complete or not, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := CHECKPOINT_NAME.match(p.name)) and p.is_dir()]
    return sorted(found)


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every finished checkpoint under `root`, oldest first."""
    return [(step, path) for step, path in checkpoint_dirs(root) if (path / COMPLETE_MARKER).is_file()]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint; `.tmp`, marker-less and abandoned directories are ignored."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def start_branch(root: str | Path, resume_from: str | Path) -> bool:
    """Make `resume_from` the head of `root`'s lineage before a run resumes from it; True when that
    starts a new branch.

    Every checkpoint under `root` that is no ancestor of `resume_from` (those of its step or
    later; all of them when `resume_from` lies elsewhere) is set aside, with a warning.
    """
    root, resume_from = Path(root), Path(resume_from)
    inside = resume_from.resolve().parent == root.resolve()
    match = CHECKPOINT_NAME.match(resume_from.name) if inside else None
    others = [path for step, path in checkpoint_dirs(root)
              if match is None or (step >= int(match.group(1)) and path.name != resume_from.name)]
    return set_aside(root, others, f"resuming from {resume_from} starts a new branch") is not None


def set_aside_from(root: Path, step: int) -> None:
    """Set aside the checkpoints of `step` or later: a run saving `step` has left their history."""
    later = [path for s, path in checkpoint_dirs(root) if s >= step]
    set_aside(root, later, f"a checkpoint of step {step} is being saved")


def set_aside(root: Path, paths: list[Path], reason: str) -> Path | None:
    """Move `paths` to a new folder under `root/abandoned/`, durably, warning where; None when none."""
    if not paths:
        return None
    (root / ABANDONED).mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    folder = Path(tempfile.mkdtemp(dir=root / ABANDONED, prefix=f"{stamp}-{paths[0].name}-"))
    for path in paths:
        path.rename(folder / path.name)
    fsync_directory(folder)
    fsync_directory(root / ABANDONED)
    fsync_directory(root)
    names = ", ".join(p.name for p in paths)
    warnings.warn(f"{reason}: the checkpoints of the abandoned history ({names}) are moved to {folder}; "
                  "resume=auto no longer finds them (resume=<path> still can; delete them when unwanted)",
                  stacklevel=3)
    return folder


def rotate_checkpoints(root: Path, keep_last: int | None) -> None:
    """Delete complete checkpoints beyond the newest `keep_last`, and leftovers of crashed saves."""
    # Called after this save is published, and only run_dir's owner saves here (run_owner.py): any `.tmp` left is a dead launch's.
    for path in root.glob("step_*.tmp"):
        shutil.rmtree(path, ignore_errors=True)
    if keep_last is None:
        return
    for _, path in complete_checkpoints(root)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
