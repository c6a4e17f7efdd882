"""A full disk, recognised and named with the path and the bytes that were missing.

Python's `[Errno 28] No space left on device` from a write names no file, and torch's zip
writer loses the errno altogether ("unexpected pos ..."): so a failed write is judged by the
error's errno or, failing that, by the free space left where it wrote.
"""
from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

# Below this many free bytes after a failed write, the write failed for want of space.
FULL_SLACK_BYTES = 1 << 20
OUT_OF_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the file system holding `path` (or its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def is_out_of_space(error: BaseException, path: Path) -> bool:
    """Whether `error`, raised by a write under `path`, came from a full file system or quota."""
    if isinstance(error, OSError) and error.errno in OUT_OF_SPACE_ERRNOS:
        return True
    return isinstance(error, (OSError, RuntimeError)) and free_bytes(path) < FULL_SLACK_BYTES


def bytes_under(path: Path) -> int:
    """Total size of the files under `path` (0 when it is absent)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


class OutOfSpaceError(OSError):
    """A write ran out of space; the message names the path, what it needed and what was free."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        # Ray pickles errors raised in actors; OSError's own reduce would drop the message.
        return type(self), (self.message,)


@contextmanager
def path_named(path: Path) -> Iterator[None]:
    """Re-raise an `OSError` of a write to `path` that names no file as one that does
    (a full disk says how much is free there)."""
    try:
        yield
    except OSError as error:
        if error.filename is not None or error.errno is None or isinstance(error, OutOfSpaceError):
            raise
        if error.errno in OUT_OF_SPACE_ERRNOS:
            raise OutOfSpaceError(f"no space left to write {path}: {free_bytes(path)} bytes free on its file system "
                                  f"({os.strerror(error.errno)})") from error
        raise type(error)(error.errno, error.strerror, str(path)) from error
