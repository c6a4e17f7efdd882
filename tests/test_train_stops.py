"""Stops: `python -m specroll.train` on the smoke preset, sent SIGTERM (what `kill`, `ray job stop` and
schedulers send, to the driver) or SIGINT (Ctrl-C, to the terminal's whole process group) mid-run,
ends with one line naming the signal, the step, the last complete checkpoint and the command that
continues, exit status 128 + the signal (143, 130), no traceback and no native stack dump; it gives
up the run_dir and leaves no half-written save; and `resume=auto` then continues, each step once
in metrics.jsonl."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKOUT_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
pytestmark = pytest.mark.ray  # each launch starts a local cluster of its own
SMOKE = ["experiment=smoke", "run_dir=run", "logger.console=false"]
STARTED_S = 300  # a launch's start (Ray, actors, models) on a busy 2-core machine, with room
NATIVE_DUMP = ("*** SIGTERM received", "PC: @", "Fatal Python error")


def launch(tmp_path: Path, overrides: list[str]) -> subprocess.Popen:
    """The command as a user runs it, in a session of its own (its process group is what Ctrl-C reaches)."""
    return subprocess.Popen([sys.executable, "-m", "specroll.train", *SMOKE, *overrides], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=CHECKOUT_ENV)


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def stopped(tmp_path: Path, signum: int, to_group: bool, overrides: list[str]) -> tuple[int, str]:
    """A launch sent `signum` a few steps in (to its process group, as Ctrl-C, or to the driver alone);
    returns its exit status and stderr."""
    run_dir, first = tmp_path / "run", len(logged_steps(tmp_path / "run"))
    driver = launch(tmp_path, overrides)
    try:
        started = time.monotonic()
        while len(logged_steps(run_dir)) < first + 3:  # mid-run: steps of a fraction of a second, each saved
            assert driver.poll() is None and time.monotonic() - started < STARTED_S, driver.communicate()
            time.sleep(0.05)
        (os.killpg if to_group else os.kill)(driver.pid, signum)
        _, stderr = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    return driver.returncode, stderr


def test_sigterm_and_sigint_end_the_run_in_one_line_and_resume_auto_continues(tmp_path):
    run_dir = tmp_path / "run"
    for signum, to_group, overrides in ((signal.SIGTERM, False, ["total_steps=200"]),
                                        (signal.SIGINT, True, ["total_steps=200", "resume=auto"])):
        status, stderr = stopped(tmp_path, signum, to_group, overrides)
        assert status == 128 + signum, stderr
        checkpoint = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
        last = stderr.strip().splitlines()[-1]
        assert last.startswith(f"stopped by {signal.Signals(signum).name} during step "), stderr
        assert last.endswith(f"; the last complete checkpoint is {checkpoint}; to continue from it: python -m "
                             f"specroll.train {' '.join(SMOKE)} total_steps=200 resume=auto"), stderr
        assert "Traceback" not in stderr and not any(dump in stderr for dump in NATIVE_DUMP), stderr
        assert not list((run_dir / "checkpoints").glob("*.tmp")) and not (run_dir / "OWNER.json").exists()

    done = int(checkpoint.name.split("_")[1])  # steps the newest checkpoint covers
    resumed = launch(tmp_path, [f"total_steps={done + 2}", "resume=auto"])
    stdout, stderr = resumed.communicate(timeout=STARTED_S)
    assert resumed.returncode == 0, stderr
    assert f"steps {done}-{done + 1} done" in stdout
    assert logged_steps(run_dir) == list(range(done + 2))
