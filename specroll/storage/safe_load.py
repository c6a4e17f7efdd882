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
import re
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

    Raises `UnsafeCheckpointError` naming the types the file needs beyond those.
    """
    path = Path(path)
    allowed = allowed or []
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        named = re.findall(r"GLOBAL ([\w.]+)", str(exc))
        raise UnsafeCheckpointError(path, named or unsafe_types(path, [type_name(t) for t in allowed])) from None


def type_name(t: type) -> str:
    """`t` as a pickle names it (module and qualified name)."""
    return f"{t.__module__}.{t.__qualname__}"


def unsafe_types(path: str | Path, allowed: list[str] | tuple[str, ...] = ()) -> list[str]:
    """What `path` names beyond tensors, containers and the `allowed` type names: read from the
    pickle's opcodes, nothing run."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except (ValueError, RuntimeError):
        return ["an unreadable or pre-2020 torch.save format, which SpecRoll never writes"]
    return [name for name in names if name not in allowed]
