"""Reading `.pt` files without running code from them.

A `.pt` file is a pickle, and unpickling may call any function the file names: a checkpoint
someone downloaded could run a shell command on load (its `COMPLETE` marker proves nothing
about origin, it is recomputed as easily). So every `.pt` is read with
`torch.load(weights_only=True)`, which rebuilds tensors and plain containers only, plus the
types a caller allows for that one load (never process-wide). A file naming anything else is
refused, naming the file and the type.
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch


class UnsafeCheckpointError(ValueError):
    """A checkpoint file needs a type outside the allow-list to load: it is not read."""

    def __init__(self, file: Path, types: list[str]) -> None:
        self.file, self.types = Path(file), types
        super().__init__(
            f"refusing to load {file}: it names {', '.join(types)}, which SpecRoll's own checkpoints never hold "
            "(loading it could run code from the file); use checkpoints from a source you trust and that this "
            "version of SpecRoll wrote"
        )

    def __reduce__(self):
        # Ray pickles errors raised in actors; the default would call __init__ with the message alone.
        return type(self), (self.file, self.types)


def load_state(path: str | Path, allowed: list[type] | None = None) -> Any:
    """`torch.load` of `path` onto the CPU, tensors and containers only, plus the `allowed` types.

    Raises `UnsafeCheckpointError` naming every other type the file names.
    """
    path = Path(path)
    allowed = allowed or []
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        names = {f"{t.__module__}.{t.__qualname__}" for t in allowed}
        unsafe = [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(path) if g not in names]
        raise UnsafeCheckpointError(path, unsafe or [str(exc).splitlines()[0]]) from None
