"""Files that survive a crash and concurrent writers (fsynced writes, atomic replacement), and a full
disk named. (`.pt` files read without running code: `safe_load.py`, which needs torch.)"""
from .disk_space import OutOfSpaceError, bytes_under, free_bytes, is_out_of_space, path_named
from .durable_files import fsync_directory, fsync_tree, publish_directory, write_atomically, write_durably

__all__ = [
    "OutOfSpaceError",
    "bytes_under",
    "free_bytes",
    "fsync_directory",
    "fsync_tree",
    "is_out_of_space",
    "path_named",
    "publish_directory",
    "write_atomically",
    "write_durably",
]
