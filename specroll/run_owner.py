"""One owner per run_dir: a launch holds `run_dir/OWNER.json` for its life, so a second launch on
the same run_dir is refused before it writes anything (its config, token, metrics or checkpoints
would otherwise interleave with the first's).

The file is created with O_CREAT|O_EXCL, atomic on local file systems and NFS v3 or later (and
most shared file systems a cluster mounts); the owner refreshes its mtime every step as a
heartbeat. A record left by a dead launch is taken over: on this host when its process is gone
(or the pid now belongs to a process started at another time); from another host, whose
processes cannot be seen from here, only once its heartbeat is older than `OWNER_STALE_S`.
"""
from __future__ import annotations

import json
import os
import socket
import time
import warnings
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path

import psutil

OWNER_NAME = "OWNER.json"  # under run_dir: the launch that owns it
# A foreign host's heartbeat this old means its launch is dead: far beyond one step plus a checkpoint's save.
OWNER_STALE_S = 3600.0
START_TOLERANCE_S = 1.0  # process start times read twice may differ by clock-tick rounding


class RunDirOwnedError(RuntimeError):
    """Another live launch owns the run_dir."""


@dataclass(frozen=True)
class Owner:
    """The launch that owns a run_dir, as `OWNER.json` records it."""

    host: str
    pid: int
    process_started: float  # the process's start time (seconds since the epoch): tells a reused pid apart
    started: str  # when it took the run_dir, UTC, for people

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started}"


class Action(Enum):
    TAKE = "take"  # nobody owns the run_dir
    REFUSE = "refuse"  # a live launch owns it
    TAKE_OVER = "take over"  # its owner is dead


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str  # why, for the message or warning


def decide(owner: Owner | None, host: str, heartbeat_age_s: float, running_since: float | None,
            stale_s: float = OWNER_STALE_S) -> Decision:
    """What a launch on `host` does about a run_dir `owner` holds (None: unowned). `running_since`:
    the start time of the process with the owner's pid on this host (None: no such process);
    `heartbeat_age_s`: seconds since the owner last refreshed its record."""
    if owner is None:
        return Decision(Action.TAKE, "no owner")
    if owner.host == host:
        if running_since is None:
            return Decision(Action.TAKE_OVER, f"its process {owner.pid} is no longer running")
        if abs(running_since - owner.process_started) > START_TOLERANCE_S:
            return Decision(Action.TAKE_OVER, f"pid {owner.pid} now belongs to another process")
        return Decision(Action.REFUSE, "its process is running on this host")
    if heartbeat_age_s > stale_s:
        return Decision(Action.TAKE_OVER, f"its heartbeat is {heartbeat_age_s:.0f} s old (limit {stale_s:.0f} s)")
    return Decision(Action.REFUSE, f"its heartbeat is {heartbeat_age_s:.0f} s old (another host's launch is "
                                  f"taken as dead only after {stale_s:.0f} s)")


def process_start(pid: int) -> float | None:
    """When the process `pid` on this host started; None when there is none."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None


def this_launch() -> Owner:
    pid = os.getpid()
    return Owner(socket.gethostname(), pid, process_start(pid),
                 time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def read_owner(path: Path) -> tuple[Owner | None, float] | None:
    """The record at `path` and its heartbeat's age; None when there is no file. A record that cannot
    be read (a launch cut while writing it) counts as another host's, so only its age frees it."""
    try:
        text, age = path.read_text(), time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        return Owner(**json.loads(text)), age
    except (ValueError, TypeError):
        return Owner("(unreadable record)", -1, 0.0, "?"), age


def take_ownership(run_dir: Path) -> Owner:
    """Make this launch the owner of `run_dir` (created if missing); raise `RunDirOwnedError` naming
    the live owner, or warn naming a dead one taken over."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path, me = run_dir / OWNER_NAME, this_launch()
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            found = read_owner(path)
            if found is None:  # released between the two calls
                continue
            owner, age = found
            running = process_start(owner.pid) if owner.host == me.host else None
            decided = decide(owner, me.host, age, running)
            if decided.action is Action.REFUSE:
                raise RunDirOwnedError(
                    f"run_dir {run_dir} is in use by another launch: {owner.describe()} ({decided.reason}); "
                    f"wait for it to end or stop it, or choose another run_dir (if that launch is dead, "
                    f"delete {path})") from None
            set_aside_stale(path, owner)
            warnings.warn(f"taking over run_dir {run_dir} from a dead launch: {owner.describe()} ({decided.reason})",
                          stacklevel=2)
            continue
        with os.fdopen(fd, "w") as file:
            file.write(json.dumps(asdict(me)))
            file.flush()
            os.fsync(file.fileno())
        return me


def set_aside_stale(path: Path, dead: Owner) -> None:
    """Remove `dead`'s record at `path`. It is renamed aside first and put back when it turns out to be
    another's: of two launches taking over at once, the slower must not remove the winner's new record."""
    aside = path.with_name(f"{path.name}.stale-{os.getpid()}")
    try:
        path.rename(aside)
    except FileNotFoundError:
        return
    found = read_owner(aside)
    if found is not None and found[0] != dead:
        try:
            os.link(aside, path)  # back in place, unless yet another launch has created one since
        except FileExistsError:
            pass
    aside.unlink()


def heartbeat(run_dir: Path) -> None:
    """Refresh the owner record's mtime, which tells other hosts this launch is alive."""
    os.utime(run_dir / OWNER_NAME)


def release_ownership(run_dir: Path, owner: Owner) -> None:
    """Delete the owner record if it is still `owner`'s (a launch that took it over keeps it)."""
    path = run_dir / OWNER_NAME
    found = read_owner(path)
    if found is not None and found[0] == owner:
        path.unlink(missing_ok=True)
