"""Writes that survive a power loss and concurrent writers.

A rename is atomic but not durable by itself: until the file's data and the directory that
holds the new name are fsynced, a power loss can leave the new name pointing at empty or
partial data. So everything is fsynced before it is renamed into place, and the directory
after. Temporary names are unique per writer, so two processes writing the same target never
write into each other's file; the last rename wins, and each candidate is whole.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .disk_space import path_named


def fsync_directory(path: Path) -> None:
    """Make the names created, renamed or removed in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and every directory under `root`, `root` itself last."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_file(Path(directory, name))
        fsync_directory(Path(directory))


def write_durably(path: Path, text: str) -> None:
    """Write `text` to `path` and fsync it (in place: for files inside a directory renamed later)."""
    with path_named(path), open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` by a file holding `text`: readers see the old file or the new one, whole, never a part."""
    with path_named(path):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with path_named(path), os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def publish_directory(tmp: Path, target: Path) -> bool:
    """Rename the finished directory `tmp` to `target`, durably; False (and `tmp` removed) when
    another writer published `target` first."""
    fsync_tree(tmp)
    try:
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    fsync_directory(target.parent)
    return True
