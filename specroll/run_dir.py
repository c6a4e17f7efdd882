"""A run's storage: one absolute run_dir, outside Ray's per-job working directory, writable, and
the same folder for the driver and every actor (a token file the driver writes and each checks).

Under `ray job submit` a relative run_dir lands in the job's unpacked working directory
(`.../runtime_resources/working_dir_files/_ray_pkg_<hash>/`), which a resubmission replaces;
on several nodes a relative path (or a local disk) means a different folder on each.
"""
from __future__ import annotations

import os
import socket
import tempfile
import uuid
from pathlib import Path

from specroll.storage import bytes_under, free_bytes, write_atomically

CHECKPOINTS = "checkpoints"  # under run_dir
TOKEN_NAME = ".specroll-run"  # under run_dir: this launch's token, written by the driver
CONFIG_NAME = "config.yaml"  # under run_dir: the resolved config of the latest launch
LAUNCH_FILES = (CONFIG_NAME, TOKEN_NAME)  # what a launch writes into run_dir before Ray starts
RAY_JOB_DIR_PARTS = ("runtime_resources", "working_dir_files")  # Ray's per-job working directory


class RunDirNotSharedError(RuntimeError):
    """An actor does not see the run_dir the driver wrote its token into."""


def absolute_path(path: str) -> Path:
    """`path` made absolute (`~` expanded, relative to the working directory), its links left as they are."""
    return Path(os.path.abspath(Path(path).expanduser()))


def run_dir_problems(run_dir: Path, checkpoints: Path) -> list[str]:
    """What keeps `run_dir` (absolute) from holding this run: inside Ray's per-job working
    directory, it or its checkpoints folder not writable, a folder where a launch writes a file, or
    too little space for its next checkpoint. Writes nothing that stays."""
    parts = run_dir.parts
    if any(parts[i:i + 2] == RAY_JOB_DIR_PARTS for i in range(len(parts) - 1)):
        return [f"run_dir: {run_dir} is inside Ray's per-job working directory, which the next submission "
                "replaces (its checkpoints would be lost); set run_dir to an absolute path on storage every "
                "node sees, e.g. run_dir=/mnt/shared/runs/NAME"]
    problems = [f"run_dir: {run_dir / name} is not a file, and a launch writes that file (remove or rename it)"
                for name in LAUNCH_FILES if (run_dir / name).exists() and not (run_dir / name).is_file()]
    for where, folder in (("run_dir", run_dir), ("run_dir's checkpoints folder", checkpoints)):
        existing = nearest_existing(folder)
        if not existing.is_dir():
            problems.append(f"{where}: {existing} is not a folder, so {folder} cannot be created")
            break
        reason = unwritable(existing)
        if reason is not None:
            made = "" if existing == folder else f" (to create {folder})"
            problems.append(f"{where}: cannot write in {existing}{made}: {reason}")
            break
    space = space_problem(checkpoints)
    if space is not None:
        problems.append(space)
    return problems


def space_problem(checkpoints: Path) -> str | None:
    """Why the next checkpoint cannot fit beside the newest (as large as it) in `checkpoints`; None when it can
    or when no checkpoint tells its size."""
    if not checkpoints.is_dir():
        return None
    from specroll.learner.lineage import complete_checkpoints  # the learner package loads torch: only for a resume

    complete = complete_checkpoints(checkpoints)
    if not complete:
        return None
    newest = complete[-1][1]
    needed, free = bytes_under(newest), free_bytes(checkpoints)
    if free >= needed:
        return None
    return (f"run_dir's checkpoints folder: {checkpoints} has {free} bytes free, and its next checkpoint needs about "
            f"{needed} (the size of {newest.name}); free space or move run_dir to a larger disk")


def nearest_existing(path: Path) -> Path:
    """`path` itself when it exists, else its nearest ancestor that does."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def unwritable(folder: Path) -> str | None:
    """Why no file can be created in `folder`; None when one can. Tried, not inferred from
    permission bits, which root, ACLs, read-only mounts and immutable folders each defeat."""
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".specroll-probe-")
    except OSError as error:
        return error.strerror or str(error)
    os.close(fd)
    os.unlink(probe)
    return None


def write_run_token(run_dir: Path) -> str:
    """A new token for this launch, written to `run_dir/TOKEN_NAME`; returns it."""
    token = f"{uuid.uuid4().hex} from the driver on node {socket.gethostname()}"
    write_atomically(run_dir / TOKEN_NAME, token)
    return token


def check_run_token(run_dir: str, token: str) -> None:
    """Raise `RunDirNotSharedError` unless `run_dir/TOKEN_NAME` holds `token` as this process sees it."""
    path = Path(run_dir) / TOKEN_NAME
    try:
        seen = path.read_text()
    except FileNotFoundError:
        seen = None
    if seen == token:
        return
    found = "no token file" if seen is None else "another launch's token"
    raise RunDirNotSharedError(
        f"node {socket.gethostname()} finds {found} at {path}, where this launch wrote {token.split()[0]} "
        f"{token.split(' ', 1)[1]}: run_dir must be on storage every node shares, at the same path "
        "(a shared or network file system), not a node's local disk")


class SeesRunDir:
    """For an actor: the driver asks it, before step 0, whether it sees the driver's run_dir."""

    def check_run_dir(self, run_dir: str, token: str) -> None:
        check_run_token(run_dir, token)
