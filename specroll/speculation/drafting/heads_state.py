"""The draft heads as they travel: from a rollout actor to the head-consolidation actor, from it to
every rollout actor, and into and out of a run checkpoint's `heads.pt`."""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specroll.storage.safe_load import load_state

from .heads import HeadsMeta, HorizonHeads


@dataclass(frozen=True)
class HeadsState:
    """One version of the draft heads, and the slow path's state that goes with it."""

    version: int  # bumped by every published head update
    state: dict[str, torch.Tensor]  # `HorizonHeads.state_dict()`, on the CPU
    meta: HeadsMeta | None  # what the heads are (type, sizes, base model); None: the holder's own
    consolidation: dict[str, Any] | None = None  # `HeadConsolidator.state_dict()`; None without one, in broadcasts

    @classmethod
    def of(cls, heads: HorizonHeads) -> HeadsState:
        """`heads` as they travel: their version and meta, their weights copied to the CPU."""
        state = {k: v.detach().to("cpu", copy=True) for k, v in heads.state_dict().items()}
        return cls(heads.version, state, heads.meta())

    def applied_to(self, heads: HorizonHeads) -> HorizonHeads:
        """A copy of `heads` holding these weights and this version."""
        updated = copy.deepcopy(heads)
        updated.load_state_dict(self.state)
        updated.version = self.version
        return updated

    def save(self, path: str | Path) -> None:
        """As a run checkpoint's `heads.pt`: dicts, tensors and numbers only, so that it loads with
        `weights_only=True` and names no class of ours (a moved module cannot break loading)."""
        meta = None if self.meta is None else asdict(self.meta)
        torch.save({"version": self.version, "state": self.state, "meta": meta, "consolidation": self.consolidation},
                   path)

    @classmethod
    def load(cls, path: str | Path) -> HeadsState:
        """What `save` wrote; a file without "meta" or "consolidation" (the oldest checkpoints)
        loads with None there."""
        saved = load_state(path)
        missing = {"version", "state"} - set(saved)
        if missing:
            raise ValueError(f"{path} lacks {sorted(missing)} of the saved heads; it holds {sorted(saved)}")
        meta = saved.get("meta")
        return cls(version=int(saved["version"]), state=dict(saved["state"]),
                   meta=HeadsMeta(**meta) if meta else None, consolidation=saved.get("consolidation"))
