"""Files that survive a crash and concurrent writers: fsynced writes, atomic replacement."""
from .durable_files import fsync_directory, fsync_tree, publish_directory, write_atomically, write_durably

__all__ = ["fsync_directory", "fsync_tree", "publish_directory", "write_atomically", "write_durably"]
