"""A process's resident memory from /proc (Linux): what it holds now and its peak since a reset.

`ru_maxrss` is not used: a process started by fork and exec inherits its parent's peak, so a
measuring child of a large test worker would report the worker's memory.
"""
from __future__ import annotations

import os


def proc_figure(pid: int, name: str, field: str) -> int:
    """A figure of process `pid` from /proc: `field` of its `name` file (status figures in kB, as bytes)."""
    with open(f"/proc/{pid}/{name}") as f:
        value = next(line.split()[1] for line in f if line.startswith(field + ":"))
    return int(value) * (1024 if name == "status" else 1)


def reset_peak(pid: int | None = None) -> None:
    """Start process `pid`'s (default: this one's) peak resident memory (VmHWM) afresh from what it holds now."""
    with open(f"/proc/{pid or os.getpid()}/clear_refs", "w") as f:
        f.write("5")


def resident_bytes(pid: int | None = None) -> int:
    return proc_figure(pid or os.getpid(), "status", "VmRSS")


def peak_resident_bytes(pid: int | None = None) -> int:
    return proc_figure(pid or os.getpid(), "status", "VmHWM")
