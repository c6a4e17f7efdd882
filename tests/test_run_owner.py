"""One owner per run_dir: the decision on hand-worked cases, and the lock file taken, refused,
taken over and released for real (the launches that meet it: test_train_inputs.py)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from specroll.run_owner import (
    OWNER_NAME,
    OWNER_STALE_S,
    Action,
    Owner,
    RunDirOwnedError,
    decide,
    heartbeat,
    release_ownership,
    set_aside_stale,
    take_ownership,
)

HERE = "node-a"
STARTED = 1_700_000_000.0
OWNER = Owner(HERE, 4242, STARTED, "2026-12-07T12:00:00Z")


@pytest.mark.parametrize("owner, host, age, running_since, action", [
    (None, HERE, 0.0, None, Action.TAKE),
    (OWNER, HERE, 5.0, STARTED, Action.REFUSE),  # alive, the same process
    (OWNER, HERE, 5.0, STARTED + 0.5, Action.REFUSE),  # start time read with rounding
    (OWNER, HERE, 5.0, None, Action.TAKE_OVER),  # its pid is gone
    (OWNER, HERE, 5.0, STARTED + 3600, Action.TAKE_OVER),  # pid reused by a later process
    (OWNER, HERE, 10 * OWNER_STALE_S, STARTED, Action.REFUSE),  # alive here however old its heartbeat
    (OWNER, "node-b", 60.0, None, Action.REFUSE),  # another host's, heartbeat fresh
    (OWNER, "node-b", OWNER_STALE_S + 1, None, Action.TAKE_OVER),  # another host's, heartbeat stale
])
def test_the_decision_on_hand_worked_cases(owner, host, age, running_since, action):
    assert decide(owner, host, age, running_since).action is action


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_a_live_owner_is_refused_by_name_and_keeps_its_record(tmp_path):
    mine = take_ownership(tmp_path)
    record = (tmp_path / OWNER_NAME).read_text()
    with pytest.raises(RunDirOwnedError) as refused:
        take_ownership(tmp_path)
    message = str(refused.value)
    assert f"pid {os.getpid()} on host {socket.gethostname()}, started {mine.started}" in message
    assert "wait for it to end or stop it, or choose another run_dir" in message
    assert (tmp_path / OWNER_NAME).read_text() == record
    release_ownership(tmp_path, mine)
    assert not (tmp_path / OWNER_NAME).exists()
    release_ownership(tmp_path, take_ownership(tmp_path))  # free again


def test_a_dead_owner_on_this_host_is_taken_over_with_a_warning(tmp_path):
    pid = dead_pid()
    dead = {"host": socket.gethostname(), "pid": pid, "process_started": 1.0, "started": "2026-12-07T11:00:00Z"}
    (tmp_path / OWNER_NAME).write_text(json.dumps(dead))
    with pytest.warns(UserWarning, match=f"from a dead launch: pid {pid} on host .*no longer running"):
        mine = take_ownership(tmp_path)
    assert json.loads((tmp_path / OWNER_NAME).read_text())["pid"] == os.getpid()
    assert [p.name for p in tmp_path.iterdir()] == [OWNER_NAME]  # the dead record set aside and gone
    release_ownership(tmp_path, mine)


def test_another_hosts_owner_is_refused_until_its_heartbeat_is_stale(tmp_path):
    other = {"host": "elsewhere", "pid": os.getpid(), "process_started": 1.0, "started": "2026-12-07T11:00:00Z"}
    path = tmp_path / OWNER_NAME
    path.write_text(json.dumps(other))
    with pytest.raises(RunDirOwnedError, match="pid .* on host elsewhere"):
        take_ownership(tmp_path)
    old = time.time() - OWNER_STALE_S - 60
    os.utime(path, (old, old))
    with pytest.warns(UserWarning, match="host elsewhere.*heartbeat is"):
        release_ownership(tmp_path, take_ownership(tmp_path))


def test_the_heartbeat_refreshes_the_records_mtime(tmp_path):
    mine = take_ownership(tmp_path)
    os.utime(tmp_path / OWNER_NAME, (1.0, 1.0))
    heartbeat(tmp_path)
    assert time.time() - (tmp_path / OWNER_NAME).stat().st_mtime < 60
    release_ownership(tmp_path, mine)


def test_release_leaves_a_record_that_is_not_its_own(tmp_path):
    mine = take_ownership(tmp_path)
    (tmp_path / OWNER_NAME).write_text(json.dumps({**mine.__dict__, "pid": mine.pid + 1}))
    release_ownership(tmp_path, mine)
    assert (tmp_path / OWNER_NAME).exists()


def test_a_slower_take_over_leaves_the_winners_new_record(tmp_path):
    """Two launches judged the same record dead; the first has already replaced it with its own."""
    winner = take_ownership(tmp_path)
    record = (tmp_path / OWNER_NAME).read_text()
    set_aside_stale(tmp_path / OWNER_NAME, OWNER)  # the slower launch removes what it judged dead
    assert (tmp_path / OWNER_NAME).read_text() == record
    assert [p.name for p in tmp_path.iterdir()] == [OWNER_NAME]
    release_ownership(tmp_path, winner)
