"""A save into a full file system (a small tmpfs, mounted in a user and mount namespace of its own)
says so, naming the path and the bytes it needed; leaves no `.tmp`; the previous checkpoint stays
the one resume=auto takes; preflight names the shortfall; and a launch's next write names its file.
Through the driver too: the run stops naming it all, and the next launch is refused before Ray starts."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAVE_SCRIPT = ROOT / "tests" / "save_into_full_disk.py"
TRAIN_SCRIPT = ROOT / "tests" / "train_into_full_disk.py"
TMPFS_SIZE = "256m"  # room for a smoke run's first checkpoint (~50 MB); the scripts fill the rest


def run_in_tmpfs(script: Path, mount_point: Path) -> dict:
    """Run `script` with a tmpfs on `mount_point`; skips where no namespace or tmpfs can be had."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here: cannot mount a small tmpfs without root")
    probe = subprocess.run(["unshare", "-rm", "mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs",
                            str(mount_point)], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (unshare -rm mount: {probe.stderr.strip()})")
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size={TMPFS_SIZE} tmpfs "$1" && exec "$2" "$3" "$1"', "sh",
         str(mount_point), sys.executable, str(script)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_save_into_a_full_disk_is_named_and_leaves_the_previous_checkpoint(tmp_path):
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    seen = run_in_tmpfs(SAVE_SCRIPT, mount_point)
    checkpoints = mount_point / "run" / "checkpoints"
    first, size = checkpoints / "step_00000001", seen["first_bytes"]

    assert seen["save_error"].startswith(
        f"OutOfSpaceError: no space left on device to save checkpoint {checkpoints / 'step_00000002'} "
        f"(writing {checkpoints / 'step_00000002.tmp'}): it needs about {size} bytes (the size of step_00000001)")
    assert f"{first} stays the newest checkpoint (resume=auto continues from it)" in seen["save_error"]
    assert seen["left"] == ["step_00000001"]  # no .tmp keeps the disk full
    assert seen["resumes_from"] == str(first)
    (problem,) = seen["preflight"]
    free = int(re.fullmatch(rf"run_dir's checkpoints folder: {checkpoints} has (\d+) bytes free, and its next "
                            rf"checkpoint needs about {size} \(the size of step_00000001\); free space or move "
                            r"run_dir to a larger disk", problem).group(1))
    assert free < size
    assert seen["launch_error"].startswith(f"OutOfSpaceError: no space left to write {mount_point / 'run/config.yaml'}")


@pytest.mark.ray
def test_a_run_that_fills_its_disk_stops_naming_it_and_the_next_launch_is_refused_before_ray(tmp_path):
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    seen = run_in_tmpfs(TRAIN_SCRIPT, mount_point)
    checkpoints = mount_point / "run" / "checkpoints"

    assert seen["first"].startswith(
        "ActorFailedError: learner rank 0 failed in save_checkpoint (step 2): OutOfSpaceError: no space left on device "
        f"to save checkpoint {checkpoints / 'step_00000002'} (writing {checkpoints / 'step_00000002.tmp'}): it needs "
        "about ")
    assert f"{checkpoints / 'step_00000001'} stays the newest checkpoint" in seen["first"]
    assert seen["left after first"] == seen["left after second"] == ["step_00000001"]
    assert re.fullmatch(rf"PreflightError: the run cannot start: run_dir's checkpoints folder: {checkpoints} has \d+ "
                        r"bytes free, and its next checkpoint needs about \d+ \(the size of step_00000001\); free "
                        r"space or move run_dir to a larger disk", seen["second"])
