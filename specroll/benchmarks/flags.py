"""Flags the benchmark commands share: the machine a run uses, and the sizes `--quick` picks."""

from __future__ import annotations

import argparse


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
