"""The policy a run checkpoint holds, rebuilt as the model the rollout engine runs, without a learner."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import torch

from specroll.configs import ModelSection
from specroll.learner import latest_intact_checkpoint, policy_weights
from specroll.learner.checkpoint import HEADS_FILE, STATE_FILE
from specroll.learner.lineage import COMPLETE_MARKER
from specroll.models import ModelConfig
from specroll.speculation.drafting.heads_state import HeadsState

CHECKPOINTS = "checkpoints"  # under a run_dir, as the driver writes them


class CheckpointPolicy(NamedTuple):
    """What a checkpoint holds of the policy."""

    path: Path  # the checkpoint directory
    step: int  # training steps behind it
    run_config: dict[str, Any]  # the run's resolved config (`TrainConfig.to_dict()`); empty when not saved
    model_config: ModelConfig  # the policy's architecture, as the learner saw it
    weights: dict[str, torch.Tensor]  # the learner's policy weights, our parameter names
    heads: HeadsState | None  # the draft heads saved with it; None without

    @property
    def model_section(self) -> ModelSection:
        """The run's `model` section (a checkpoint without the run's config: its model's name)."""
        return ModelSection(**(self.run_config.get("model") or {"name": self.model_config.name}))


def find_checkpoint(source: str | Path) -> Path | None:
    """`source` when it is a complete checkpoint, the newest intact one of a run_dir, else None.

    Raises `ValueError` for a run_dir whose checkpoints folder holds no intact checkpoint.
    """
    path = Path(source).expanduser()
    if (path / COMPLETE_MARKER).is_file():
        return path
    if (path / CHECKPOINTS).is_dir():
        newest = latest_intact_checkpoint(path / CHECKPOINTS)
        if newest is None:
            raise ValueError(f"run_dir {path} holds no complete, intact checkpoint under {path / CHECKPOINTS}")
        return newest
    return None


def read_checkpoint_policy(path: str | Path) -> CheckpointPolicy:
    """The policy of checkpoint `path` (its files verified against its marker first)."""
    path = Path(path)
    saved, weights = policy_weights(path)
    step = int(json.loads((path / STATE_FILE).read_text())["step"])
    heads = HeadsState.load(path / HEADS_FILE) if (path / HEADS_FILE).is_file() else None
    return CheckpointPolicy(path, step, saved.get("run") or {}, ModelConfig(**saved["model"]), weights, heads)


def checkpoint_model(policy: CheckpointPolicy, section: ModelSection | None = None, seed: int = 0):
    """`(CausalLM, tokenizer)`: the model `section` (default: the run's) describes, holding the checkpoint's weights."""
    section = section or policy.model_section
    model, tokenizer = section.load(seed=seed)
    missing, unexpected = model.load_state_dict(policy.weights, strict=False)
    # A tied LM head is one tensor saved under either name.
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"checkpoint {policy.path} does not fit model {section.name!r}: missing {missing}, "
                         f"unexpected {unexpected}")
    return model, tokenizer

