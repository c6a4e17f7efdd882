"""DeepSpeed's checkpoint files, read without unpickling and recorded as written.

DeepSpeed reads and writes its files through its engine's `checkpoint_engine`, whose reader
unpickles. `SafeCheckpointEngine` replaces that reader with `load_state` and allows the few
DeepSpeed types our own saves hold (`deepspeed_state_types`); it also records which files this
rank wrote, so that each rank hashes its own.
"""
from __future__ import annotations

import importlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from specroll.storage.safe_load import load_state


# What DeepSpeed's ZeRO 1-3 optimizer states pickle besides tensors and containers (DeepSpeed 0.19).
DEEPSPEED_STATE_TYPES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def deepspeed_state_types() -> list[type]:
    """`DEEPSPEED_STATE_TYPES` imported (only a learner rank, which runs DeepSpeed, needs them)."""
    types = []
    for name in DEEPSPEED_STATE_TYPES:
        module, _, attribute = name.rpartition(".")
        types.append(getattr(importlib.import_module(module), attribute))
    return types


class SafeCheckpointEngine:
    """DeepSpeed's checkpoint reader and writer, reading with `load_state` and recording what it writes.

    Installed on an engine by `SafeCheckpointEngine.of`; everything else is DeepSpeed's own.
    """

    def __init__(self, inner) -> None:
        self.inner = inner
        self.written: list[Path] | None = None

    @classmethod
    def of(cls, engine) -> SafeCheckpointEngine:
        """The engine's reader and writer, made safe once (idempotent)."""
        if not isinstance(engine.checkpoint_engine, cls):
            engine.checkpoint_engine = cls(engine.checkpoint_engine)
        return engine.checkpoint_engine

    def load(self, path: str, map_location=None) -> Any:
        # DeepSpeed asks for the CPU in every load our checkpoints take (and moves what it needs).
        return load_state(path, deepspeed_state_types())

    def save(self, state_dict, path: str) -> None:
        self.inner.save(state_dict, path)
        if self.written is not None:
            self.written.append(Path(path))

    @contextmanager
    def recording(self) -> Iterator[list[Path]]:
        """The files this rank's engine writes while the context lasts."""
        self.written = []
        try:
            yield self.written
        finally:
            self.written = None

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
