"""Checkpoints saved into a small file system that fills up: the full-disk test's run, in the mount
namespace that holds that file system.

    python tests/save_into_full_disk.py DIR

DIR is an empty small tmpfs. Saves step 1 of a tiny learner there, fills the disk up to half a
checkpoint's size, saves step 2, then fills the rest and writes a launch's config file, then
asks preflight's run_dir check. Prints one JSON object: what each failure said and what was left.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from specroll.learner import latest_intact_checkpoint, save_checkpoint  # noqa: E402
from specroll.run_dir import run_dir_problems  # noqa: E402
from specroll.storage import bytes_under, free_bytes, write_atomically  # noqa: E402
from test_learner_checkpoint import make_learner, random_samples  # noqa: E402


def fill(path: Path, leave: int) -> None:
    """Write `path` until `leave` bytes are left free on its file system."""
    with open(path, "ab") as f:
        f.write(b"\0" * max(0, free_bytes(path.parent) - leave))


def main(root: Path) -> dict:
    checkpoints = root / "run" / "checkpoints"
    learner = make_learner(zero_stage=2)
    learner.update(random_samples(4, seed=1))
    first = save_checkpoint(learner, checkpoints, step=1)
    fill(root / "filler", leave=bytes_under(first) // 2)
    result = {"first": str(first), "first_bytes": bytes_under(first)}
    try:
        save_checkpoint(learner, checkpoints, step=2)
    except OSError as error:
        result["save_error"] = f"{type(error).__name__}: {error}"
    result["left"] = sorted(p.name for p in checkpoints.iterdir())
    result["resumes_from"] = str(latest_intact_checkpoint(checkpoints))
    result["preflight"] = run_dir_problems(root / "run", checkpoints)
    fill(root / "filler", leave=0)
    try:
        write_atomically(root / "run" / "config.yaml", "seed: 1\n" * 1000)
    except OSError as error:
        result["launch_error"] = f"{type(error).__name__}: {error}"
    return result


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
