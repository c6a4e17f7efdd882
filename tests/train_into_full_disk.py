"""A smoke training run whose run_dir fills up after its first checkpoint: the full-disk test's
driver, in the mount namespace that holds that small file system.

    python tests/train_into_full_disk.py DIR

DIR is an empty tmpfs. After step 0 (checkpoint step_00000001 saved) a filler leaves half a
checkpoint free, so step 1's save runs out of space; then a second launch on the same run_dir.
Prints one JSON object: what each launch said and which checkpoints were left.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from specroll.storage import bytes_under, free_bytes  # noqa: E402
from specroll.train import run_training  # noqa: E402
from test_train_inputs import config  # noqa: E402

OVERRIDES = ["checkpoint_every=1", "total_steps=3", "rollout=vanilla", "rollout.max_new_tokens=8"]


def main(root: Path) -> dict:
    run_dir = root / "run"

    def fill_after_the_first_checkpoint(step, metrics, actors):
        if step == 0:
            first = run_dir / "checkpoints" / "step_00000001"
            with open(root / "filler", "ab") as f:
                f.write(b"\0" * max(0, free_bytes(root) - bytes_under(first) // 2))

    seen = {}
    for launch, on_step_end in (("first", fill_after_the_first_checkpoint), ("second", None)):
        try:
            run_training(config(run_dir, OVERRIDES), on_step_end=on_step_end)
        except Exception as error:  # noqa: BLE001 - what the launch says is the result
            seen[launch] = f"{type(error).__name__}: {error}"
        checkpoints = run_dir / "checkpoints"
        seen[f"left after {launch}"] = sorted(p.name for p in checkpoints.iterdir()) if checkpoints.is_dir() else None
    return seen


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
