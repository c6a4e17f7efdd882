"""What the benchmark commands share: the flags of the machine a run uses, the sizes `--quick`
picks, and the `--json` output."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_machine_flags(ap: argparse.ArgumentParser) -> None:
    """--dtype, --device and --threads: the precision, device and CPU threads of the run."""
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's choice); 1 on a CPU shared with other jobs")


def fill_sizes(args: argparse.Namespace, sizes: dict[str, dict], quick: bool) -> None:
    """Every size flag left unset (None) takes its quick or full default from `sizes`."""
    for name, value in sizes["quick" if quick else "full"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def write_json(result: dict, path: Path | None) -> None:
    """Write `result` to `path` (the --json flag; nothing when None), its folder made if missing."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
