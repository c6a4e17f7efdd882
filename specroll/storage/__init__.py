"""Files that survive a crash and concurrent writers (fsynced writes, atomic replacement), a full disk
named, and `.pt` files read without running code."""
from .disk_space import OutOfSpaceError, bytes_under, free_bytes, is_out_of_space, path_named
from .durable_files import fsync_directory, fsync_tree, publish_directory, write_atomically, write_durably
from .safe_load import UnsafeCheckpointError, load_state, type_name, unsafe_types

__all__ = [
    "OutOfSpaceError",
    "UnsafeCheckpointError",
    "bytes_under",
    "free_bytes",
    "fsync_directory",
    "fsync_tree",
    "is_out_of_space",
    "load_state",
    "path_named",
    "publish_directory",
    "type_name",
    "unsafe_types",
    "write_atomically",
    "write_durably",
]
