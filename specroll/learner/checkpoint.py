"""Atomic, resumable run checkpoints, and export of the policy as a Hugging Face directory.

A checkpoint `step_XXXXXXXX/` holds the DeepSpeed state (weights, optimizer, scheduler) of
every rank, each rank's RNG states, and `state.json` with the step, policy version, data
position, W&B run id and the resolved config; the draft-head weights go to `heads.pt`.
It is written as `step_XXXXXXXX.tmp/`, finished with a `COMPLETE` marker and renamed, so a
crash mid-save leaves only a `.tmp` directory that `latest_checkpoint` never picks.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from specroll.models import ModelConfig, to_hf_state_dict

COMPLETE_MARKER = "COMPLETE"
STATE_FILE = "state.json"
HEADS_FILE = "heads.pt"
DEEPSPEED_TAG = "deepspeed"
CHECKPOINT_NAME = re.compile(r"^step_(\d{8})$")
# Fields that may change between save and resume without invalidating the saved state.
MODEL_FIELDS_FREE_TO_CHANGE = ("eos_token_ids",)
# ZeRO stage and precision decide the layout of the saved optimizer state.
LEARNER_FIELDS_FIXED = ("zero_stage", "dtype")
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass
class ResumeState:
    """What `load_checkpoint` hands back to the run loop besides the restored learner."""

    path: Path
    step: int
    policy_version: int
    data_position: dict[str, Any]
    heads: dict[str, Any] | None
    wandb_run_id: str | None
    config: dict[str, Any]


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every finished checkpoint under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = CHECKPOINT_NAME.match(path.name)
        if match and path.is_dir() and (path / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint; `.tmp` and marker-less directories are ignored."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def rng_states() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def restore_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def resolved_config(learner, run_config: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "model": learner.model_config.to_dict(),
        "learner": learner.cfg.to_dict(),
        "run": run_config or {},
    }


def write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(
    learner,
    root: str | Path,
    step: int,
    data_position: dict[str, Any] | None = None,
    heads: dict[str, Any] | None = None,
    wandb_run_id: str | None = None,
    run_config: dict[str, Any] | None = None,
    keep_last: int | None = 3,
) -> Path:
    """Write everything a run needs to resume at `step`; collective over the learner's ranks.

    Args:
        learner: the `GRPOLearner`.
        root: directory holding the run's checkpoints (shared by all ranks).
        step: the run's step counter; names the checkpoint.
        data_position: JSON-able position of the prompt stream.
        heads: draft-head weights and version (anything `torch.save` takes).
        wandb_run_id: to resume logging into the same W&B run.
        run_config: the run's whole resolved config (JSON-able), kept for the record.
        keep_last: keep this many newest checkpoints; None keeps all.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    final = checkpoint_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    learner.engine.save_checkpoint(str(tmp), tag=DEEPSPEED_TAG, save_latest=False)
    torch.save(rng_states(), tmp / f"rng_rank{rank()}.pt")
    barrier()
    if rank() == 0:
        state = {
            "step": step,
            "policy_version": learner.version,
            "data_position": data_position or {},
            "wandb_run_id": wandb_run_id,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "config": resolved_config(learner, run_config),
        }
        write_durably(tmp / STATE_FILE, json.dumps(state, indent=2))
        if heads is not None:
            torch.save(heads, tmp / HEADS_FILE)
        write_durably(tmp / COMPLETE_MARKER, f"{step}\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        rotate_checkpoints(final.parent, keep_last)
    barrier()
    return final


def rotate_checkpoints(root: Path, keep_last: int | None) -> None:
    """Delete complete checkpoints beyond the newest `keep_last`, and leftovers of crashed saves."""
    for path in root.glob("step_*.tmp"):
        shutil.rmtree(path, ignore_errors=True)
    if keep_last is None:
        return
    for _, path in complete_checkpoints(root)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)


def check_compatible(saved: dict[str, Any], learner, path: Path) -> None:
    """Raise `ValueError` naming the first field that makes the checkpoint unusable here."""
    # Compare JSON forms: the saved side went through JSON (tuples became lists).
    current = json.loads(json.dumps(resolved_config(learner, None)))
    model_fields = [f.name for f in fields(ModelConfig) if f.name not in MODEL_FIELDS_FREE_TO_CHANGE]
    checks = [("model", name) for name in model_fields] + [("learner", name) for name in LEARNER_FIELDS_FIXED]
    for section, name in checks:
        then, now = saved.get(section, {}).get(name), current[section][name]
        if then != now:
            raise ValueError(
                f"checkpoint {path} is incompatible with this run: {section}.{name} is {then!r} "
                f"in the checkpoint but {now!r} now"
            )


def load_checkpoint(learner, path: str | Path) -> ResumeState:
    """Restore the learner (weights, optimizer, scheduler, version) and this rank's RNG states."""
    path = Path(path)
    if not (path / COMPLETE_MARKER).is_file():
        raise ValueError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker)")
    state = json.loads((path / STATE_FILE).read_text())
    check_compatible(state["config"], learner, path)
    rng_file = path / f"rng_rank{rank()}.pt"
    if not rng_file.is_file():
        raise ValueError(
            f"checkpoint {path} was written by {state['world_size']} ranks and has no RNG state for rank {rank()}"
        )
    load_path, _ = learner.engine.load_checkpoint(
        str(path), tag=DEEPSPEED_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if load_path is None:
        raise ValueError(f"DeepSpeed found no state under {path / DEEPSPEED_TAG}")
    learner.version = int(state["policy_version"])
    # Our own file: it holds numpy and python RNG states, which the weights-only loader refuses.
    restore_rng_states(torch.load(rng_file, weights_only=False))
    heads_file = path / HEADS_FILE
    heads = torch.load(heads_file, weights_only=True) if heads_file.is_file() else None
    return ResumeState(
        path=path,
        step=int(state["step"]),
        policy_version=learner.version,
        data_position=state["data_position"],
        heads=heads,
        wandb_run_id=state["wandb_run_id"],
        config=state["config"],
    )


def export_hf(
    model_or_state_dict: torch.nn.Module | dict[str, torch.Tensor],
    model_config: ModelConfig,
    tokenizer,
    out_dir: str | Path,
) -> Path:
    """Write a directory `transformers.AutoModelForCausalLM.from_pretrained` loads.

    Weights keep their dtype and get HF names (`lm_head.weight` is left out when tied).
    Written to a temporary sibling and renamed, so `out_dir` is whole or absent.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty; export into a new directory")
    if isinstance(model_or_state_dict, torch.nn.Module):
        state = model_or_state_dict.state_dict()
    else:
        state = model_or_state_dict
    # Clones: safetensors refuses tensors sharing memory, as the q/k/v splits of qkv_proj do.
    hf_state = {k: v.detach().to("cpu").clone() for k, v in to_hf_state_dict(state, model_config).items()}
    hf_config = model_config.to_hf()
    hf_config.architectures = [HF_ARCHITECTURES[model_config.model_type]]
    hf_config.dtype = next(iter(hf_state.values())).dtype
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        hf_config.save_pretrained(tmp)
        save_file(hf_state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
