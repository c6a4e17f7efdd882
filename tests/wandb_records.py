"""An offline W&B run read back with W&B's own reader (`wandb leet inspect --json`): one .wandb
file per process that logged into the run, oldest first, as `wandb sync` uploads them."""
import json
import subprocess
import sys
from pathlib import Path


def wandb_records(run_dir: Path, run_id: str) -> list[dict]:
    """Every record of the W&B run `run_id` under `run_dir/wandb`, in the order they were written."""
    files = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert files, f"no offline W&B run {run_id} under {run_dir / 'wandb'}"
    records = []
    for path in files:
        printed = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                                 capture_output=True, text=True, check=True, timeout=120).stdout
        records += [json.loads(line) for line in printed.splitlines() if line.strip()]
    return records


def wandb_history(run_dir: Path, run_id: str, name: str) -> list[tuple[int, float]]:
    """(step, value of `name`) of every step the run was given, in the order it was given them."""
    rows = [record["history"]["item"] for record in wandb_records(run_dir, run_id) if record["type"] == "history"]
    return [(row["_step"], row[name]) for row in rows]


def wandb_notes(run_dir: Path, run_id: str) -> list[str | None]:
    """The notes each process that logged into the run gave it."""
    return [record["run"].get("notes") for record in wandb_records(run_dir, run_id) if record["type"] == "run"]
