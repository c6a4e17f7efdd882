"""Atomic, resumable run checkpoints, and export of the policy as a Hugging Face directory.

A checkpoint `step_XXXXXXXX/` holds the policy's weights in `policy.safetensors` (what eval
and export read), the DeepSpeed state (weights, optimizer, scheduler) of every rank, each
rank's RNG states, and `state.json` with the step, policy version, data
position, W&B run id and the resolved config; the draft-head weights go to `heads.pt`, the
FastGRPO-style drafters' online-learning states (rollout=fastgrpo) to `drafter.pt`, the
rollout actors' earlier responses kept for history lookup to `draft_history.pt`.
It is written as `step_XXXXXXXX.tmp/`, finished with a `COMPLETE` marker, fsynced (every file
and directory) and renamed, so a crash or power loss mid-save leaves only a `.tmp` directory
that `latest_checkpoint` never picks. Which checkpoints form the run's history, and which
are pruned: `lineage.py`.

The marker records every file's size and SHA-256, so damage done after the save (a truncated
copy, a full disk, bit rot) is found before loading: `verify_checkpoint` names the damaged
file and `latest_intact_checkpoint` falls back past it. Each rank hashes the files it wrote
(still in its page cache) and rank 0 gathers the records, so no rank waits in a collective
while one reads the whole checkpoint. Markers written before the hashes
(a bare step number) are accepted unverified, with a warning, so older runs still resume.
Nothing is unpickled (`storage/safe_load.py`, `deepspeed_files.py`): DeepSpeed's files too are
read with `weights_only=True`, onto the CPU (a GPU rank's files name its device, absent on a
CPU-only node), and verification refuses a `.pt` naming a type our saves never hold.
A save that fails on any rank (a full disk: named with the path and the bytes it needed)
removes its `.tmp` (every rank learns of it), so the previous checkpoint stays the newest.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from specroll.models import ModelConfig, to_hf_state_dict
from specroll.speculation.drafting.heads_state import HeadsState
from specroll.storage import (
    OutOfSpaceError,
    bytes_under,
    free_bytes,
    fsync_tree,
    is_out_of_space,
    publish_directory,
    write_durably,
)
from specroll.storage.safe_load import UnsafeCheckpointError, load_state, unsafe_types

from .collectives import barrier, objects_from_ranks, rank, world_size
from .lineage import (
    COMPLETE_MARKER,
    MIN_KEEP_LAST,
    checkpoint_dir,
    complete_checkpoints,
    rotate_checkpoints,
    set_aside_from,
)
from .deepspeed_files import DEEPSPEED_STATE_TYPES, SafeCheckpointEngine

STATE_FILE = "state.json"
POLICY_FILE = "policy.safetensors"
HEADS_FILE = "heads.pt"
DRAFTER_FILE = "drafter.pt"
DRAFT_HISTORY_FILE = "draft_history.pt"
DEEPSPEED_TAG = "deepspeed"
# Fields that may change between save and resume without invalidating the saved state.
MODEL_FIELDS_FREE_TO_CHANGE = ("eos_token_ids",)
# ZeRO stage and precision decide the layout of the saved optimizer state.
LEARNER_FIELDS_FIXED = ("zero_stage", "dtype")
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# OpenSSL's SHA-256 runs on the CPU's SHA extensions where they exist, faster than blake2b there.
HASH_NAME = "sha256"


class CheckpointDamagedError(ValueError):
    """A file of a complete checkpoint is missing or differs from what its marker recorded."""

    def __init__(self, checkpoint: Path, file: str, problem: str) -> None:
        self.checkpoint, self.file, self.problem = checkpoint, file, problem
        super().__init__(f"checkpoint {checkpoint} is damaged: {file} {problem}")

    def __reduce__(self):
        # Ray pickles errors raised in actors; the default would call __init__ with the message alone.
        return type(self), (self.checkpoint, self.file, self.problem)


@dataclass(frozen=True)
class FileRecord:
    """What the marker remembers of one file of the checkpoint."""

    size: int
    sha256: str


@dataclass(frozen=True)
class CompletionMarker:
    """The `COMPLETE` file: the step, and each file's record (None in markers that predate them)."""

    step: int
    files: dict[str, FileRecord] | None

    def to_json(self) -> str:
        files = {name: {"size": r.size, "sha256": r.sha256} for name, r in sorted((self.files or {}).items())}
        return json.dumps({"step": self.step, "files": files}, indent=1)

    @classmethod
    def read(cls, checkpoint: Path) -> CompletionMarker:
        text = (checkpoint / COMPLETE_MARKER).read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CheckpointDamagedError(checkpoint, COMPLETE_MARKER, f"is not JSON ({exc})") from None
        if isinstance(data, int):  # the marker of checkpoints saved before file records: "<step>\n"
            return cls(step=data, files=None)
        try:
            files = {name: FileRecord(int(r["size"]), str(r["sha256"])) for name, r in data["files"].items()}
            return cls(step=int(data["step"]), files=files)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointDamagedError(checkpoint, COMPLETE_MARKER, f"lacks a field ({exc!r})") from None


@dataclass
class RngState:
    """Every random generator of a rank, as tensors and plain numbers: loads with `weights_only=True`."""

    python_version: int
    python_words: torch.Tensor  # random.getstate()'s 624 Mersenne-Twister words and its position, int64
    python_gauss: float | None  # random.gauss's cached second draw
    numpy_words: torch.Tensor  # the legacy global generator's 624 words, int64
    numpy_pos: int
    numpy_gauss: float | None  # numpy's cached gaussian, None when it holds none
    torch_cpu: torch.Tensor
    torch_cuda: list[torch.Tensor]  # one per visible device; empty without CUDA

    @classmethod
    def capture(cls) -> RngState:
        version, words, gauss = random.getstate()
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        if kind != "MT19937":
            raise ValueError(f"numpy's global generator is {kind}; only MT19937 is saved")
        return cls(
            python_version=version,
            python_words=torch.tensor(words, dtype=torch.int64, device="cpu"),
            python_gauss=gauss,
            numpy_words=torch.from_numpy(keys.astype(np.int64)),
            numpy_pos=int(pos),
            numpy_gauss=float(cached) if has_gauss else None,
            torch_cpu=torch.get_rng_state(),
            torch_cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        )

    def restore(self) -> None:
        random.setstate((self.python_version, tuple(self.python_words.tolist()), self.python_gauss))
        gauss = self.numpy_gauss
        np.random.set_state(("MT19937", self.numpy_words.numpy().astype(np.uint32), self.numpy_pos,
                             int(gauss is not None), gauss or 0.0))
        torch.set_rng_state(self.torch_cpu)
        if self.torch_cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(self.torch_cuda)

    def save(self, path: Path) -> None:
        torch.save({f.name: getattr(self, f.name) for f in fields(self)}, path)

    @classmethod
    def load(cls, path: Path) -> RngState:
        return cls(**load_state(path))


@dataclass
class ResumeState:
    """What `load_checkpoint` hands back to the run loop besides the restored learner."""

    path: Path
    step: int
    policy_version: int
    data_position: dict[str, Any]
    heads: HeadsState | None  # the draft heads and the slow path's state; None when none were saved
    wandb_run_id: str | None
    config: dict[str, Any]
    drafter: list[dict[str, Any]] | None = None  # per rollout actor: its FastGRPO drafter's online-learning state
    draft_history: list[dict[str, Any]] | None = None  # per rollout actor: its history lookup's responses


def latest_intact_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint whose files match its marker; warns naming each damaged file passed over."""
    for _, path in reversed(complete_checkpoints(root)):
        try:
            verify_checkpoint(path)
        except CheckpointDamagedError as exc:
            warnings.warn(f"{exc}; falling back to an older checkpoint", stacklevel=2)
            continue
        return path
    return None


def file_hash(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, HASH_NAME).hexdigest()


def file_hashes(files: list[Path]) -> list[str]:
    # Hashing releases the GIL: the model and optimizer files are hashed on several cores at once.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(file_hash, files))


def file_records(directory: Path, files: list[Path] | None = None) -> dict[str, FileRecord]:
    """Size and hash of `files` (default: every file under `directory` but the marker), by path relative to it."""
    if files is None:
        files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != COMPLETE_MARKER)
    return {p.relative_to(directory).as_posix(): FileRecord(p.stat().st_size, d)
            for p, d in zip(files, file_hashes(files))}


def verify_checkpoint(path: str | Path) -> CompletionMarker:
    """Check that `path` is a complete checkpoint whose files are as its marker recorded.

    Raises `ValueError` when it is no complete checkpoint, `CheckpointDamagedError` naming the
    first file missing, of another size, or with another hash, `UnsafeCheckpointError` naming a
    file that needs a type our saves never hold to load. A marker from before file records
    cannot be checked: it is accepted with a warning.
    """
    path = Path(path)
    if not (path / COMPLETE_MARKER).is_file():
        what = "does not exist" if not path.exists() else f"is not complete (no {COMPLETE_MARKER} marker)"
        raise ValueError(f"checkpoint {path} {what}")
    marker = CompletionMarker.read(path)
    if marker.files is None:
        refuse_unsafe_files(path)
        warnings.warn(f"checkpoint {path} predates file hashes in its {COMPLETE_MARKER} marker; "
                      "using it unverified", stacklevel=2)
        return marker
    # Sizes first: a truncated file is found without reading gigabytes.
    for name, record in marker.files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointDamagedError(path, name, "is missing")
        size = file.stat().st_size
        if size != record.size:
            raise CheckpointDamagedError(path, name, f"has {size} bytes; {record.size} were saved")
    names = list(marker.files)
    for name, digest in zip(names, file_hashes([path / name for name in names])):
        if digest != marker.files[name].sha256:
            raise CheckpointDamagedError(path, name, f"has another {HASH_NAME} than was saved (same size)")
    refuse_unsafe_files(path)
    return marker


def refuse_unsafe_files(path: Path) -> None:
    """Raise `UnsafeCheckpointError` for the first `.pt` under `path` that names a type our saves never
    hold: found from the pickles' opcodes, before any process loads them (the loaders refuse them too)."""
    for file in sorted(path.rglob("*.pt")):
        # RNG files from before `RngState` hold numpy arrays: never unpickled, they are skipped on load.
        legacy_rng = file.name.startswith("rng_rank")
        unsafe = [t for t in unsafe_types(file, DEEPSPEED_STATE_TYPES) if not (legacy_rng and t.startswith("numpy."))]
        if unsafe:
            raise UnsafeCheckpointError(file, unsafe)


def resolved_config(learner, run_config: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "model": learner.model_config.to_dict(),
        "learner": learner.cfg.to_dict(),
        "run": run_config or {},
    }


def save_checkpoint(
    learner,
    root: str | Path,
    step: int,
    data_position: dict[str, Any] | None = None,
    heads: HeadsState | None = None,
    wandb_run_id: str | None = None,
    run_config: dict[str, Any] | None = None,
    keep_last: int | None = 3,
    drafter: list[dict[str, Any]] | None = None,
    draft_history: list[dict[str, Any]] | None = None,
) -> Path:
    """Write everything a run needs to resume at `step`; collective over the learner's ranks.

    Args:
        learner: the `GRPOLearner`.
        root: directory holding the run's checkpoints (shared by all ranks).
        step: the run's step counter; names the checkpoint.
        data_position: JSON-able position of the prompt stream.
        heads: the draft heads and the slow path's state, kept as `heads.pt`.
        wandb_run_id: to resume logging into the same W&B run.
        run_config: the run's whole resolved config (JSON-able), kept for the record.
        keep_last: keep this many newest checkpoints (at least `MIN_KEEP_LAST`); None keeps all.
        drafter: per rollout actor, its FastGRPO drafter's state (anything `torch.save` takes).
        draft_history: per rollout actor, the responses its history lookup keeps (`SuffixDrafts.history_state`).
    """
    if keep_last is not None and keep_last < MIN_KEEP_LAST:
        raise ValueError(f"keep_last must be >= {MIN_KEEP_LAST} or None, got {keep_last}: resuming falls back "
                         "to an older checkpoint when the newest is damaged")
    final = checkpoint_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    written = attempt(lambda: write_rank_files(learner, tmp), final, tmp)
    outcomes = objects_from_ranks(SaveFailed.shareable(written))
    raise_on_failure(outcomes, written, final, tmp)
    finished: Any = None
    if rank() == 0:
        state = {
            "step": step,
            "policy_version": learner.version,
            "data_position": data_position or {},
            "wandb_run_id": wandb_run_id,
            "world_size": world_size(),
            "config": resolved_config(learner, run_config),
        }
        records = {name: record for rank_records in outcomes for name, record in rank_records.items()}
        finished = attempt(lambda: finish_save(tmp, final, state, records, heads, drafter, draft_history, keep_last),
                           final, tmp)
    raise_on_failure(objects_from_ranks(SaveFailed.shareable(finished))[:1], finished, final, tmp)
    return final


@dataclass(frozen=True)
class SaveFailed:
    """One rank's failed part of a save, as the other ranks learn of it."""

    rank: int
    error: str

    @classmethod
    def shareable(cls, outcome: Any) -> Any:
        """`outcome` as it is sent to the other ranks: an error as its message (not every error pickles)."""
        if not isinstance(outcome, Exception):
            return outcome
        named = isinstance(outcome, OutOfSpaceError)  # its message says it all
        return cls(rank(), str(outcome) if named else f"{type(outcome).__name__}: {outcome}")


def attempt(work, final: Path, tmp: Path):
    """`work()`, or the error it raised (a full disk named as such): every rank must learn of a
    failure at the next gather rather than wait there for a rank that left."""
    try:
        return work()
    except Exception as error:  # noqa: BLE001 - handed to every rank, raised below
        return out_of_space(final, tmp) if is_out_of_space(error, tmp) else error


def raise_on_failure(outcomes: list, own: Any, final: Path, tmp: Path) -> None:
    """Remove the `.tmp` and raise on every rank when any rank's part failed: this rank's own
    error where it failed, else the first failed rank's message."""
    failures = [o for o in outcomes if isinstance(o, SaveFailed)]
    if not failures:
        return
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(own, Exception):
        raise own
    raise RuntimeError(f"checkpoint {final} was not saved: rank {failures[0].rank} failed: {failures[0].error}")


def out_of_space(final: Path, tmp: Path) -> OutOfSpaceError:
    """The full disk that stopped the save of `final`, named with the bytes it needed."""
    previous = [p for _, p in complete_checkpoints(final.parent) if p != final]
    if previous:
        need = f"about {bytes_under(previous[-1])} bytes (the size of {previous[-1].name})"
        kept = f"{previous[-1]} stays the newest checkpoint (resume=auto continues from it)"
    else:
        need = f"more than the {bytes_under(tmp)} bytes it wrote before the disk filled"
        kept = "no earlier checkpoint exists"
    return OutOfSpaceError(
        f"no space left on device to save checkpoint {final} (writing {tmp}): it needs {need} and "
        f"{free_bytes(tmp)} bytes were free when it stopped; its partial files are removed and {kept}; free space "
        "or move run_dir to a larger disk, then resume"
    )


def distinct_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` on the CPU, each tensor under its first name only (safetensors refuses shared ones: tied weights)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            out[name] = tensor.detach().to("cpu").contiguous()
    return out


def write_rank_files(learner, tmp: Path) -> dict[str, FileRecord]:
    """This rank's part of the save, with the records of the files it wrote (hashed here, by this rank):
    its DeepSpeed files and RNG states, and on rank 0 the policy's weights."""
    own = [tmp / f"rng_rank{rank()}.pt"]
    with learner.gathered_state() as state:  # ZeRO-3 gathers collectively: every rank enters
        if rank() == 0:
            save_file(distinct_tensors(state), str(tmp / POLICY_FILE), metadata={"format": "pt"})
            own.append(tmp / POLICY_FILE)
    with SafeCheckpointEngine.of(learner.engine).recording() as deepspeed_files:
        learner.engine.save_checkpoint(str(tmp), tag=DEEPSPEED_TAG, save_latest=False)
    RngState.capture().save(own[0])
    fsync_tree(tmp)  # every rank: on a shared file system only the writer can flush what it wrote
    return file_records(tmp, own + deepspeed_files)


def finish_save(tmp: Path, final: Path, state: dict[str, Any], records: dict[str, FileRecord],
                heads: HeadsState | None, drafter: list | None, draft_history: list | None,
                keep_last: int | None) -> None:
    """Rank 0: the run's state beside the ranks' files, the marker over every file, then publish and rotate."""
    write_durably(tmp / STATE_FILE, json.dumps(state, indent=2))
    if heads is not None:
        heads.save(tmp / HEADS_FILE)
    if drafter is not None:
        torch.save(drafter, tmp / DRAFTER_FILE)
    if draft_history is not None:
        torch.save(draft_history, tmp / DRAFT_HISTORY_FILE)
    # What no rank recorded (this file set, DeepSpeed's recovery scripts) is hashed here.
    rest = sorted(p for p in tmp.rglob("*") if p.is_file() and p.relative_to(tmp).as_posix() not in records)
    records = {**records, **file_records(tmp, rest)}
    write_durably(tmp / COMPLETE_MARKER, CompletionMarker(state["step"], records).to_json())
    set_aside_from(final.parent, state["step"])
    if not publish_directory(tmp, final):
        raise RuntimeError(f"{final} appeared while it was being saved: two runs are writing {final.parent}")
    rotate_checkpoints(final.parent, keep_last)


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


def load_checkpoint(learner, path: str | Path, verify: bool = True) -> ResumeState:
    """Restore the learner (weights, optimizer, scheduler, version) and this rank's RNG states.

    `verify` checks every file against the marker first (`verify_checkpoint`); a caller that
    has just verified `path` (the driver, before starting the learner ranks) passes False.
    """
    path = Path(path)
    if verify:
        verify_checkpoint(path)
    elif not (path / COMPLETE_MARKER).is_file():
        raise ValueError(f"checkpoint {path} is not complete (no {COMPLETE_MARKER} marker)")
    state = json.loads((path / STATE_FILE).read_text())
    check_compatible(state["config"], learner, path)
    rng_file = path / f"rng_rank{rank()}.pt"
    if not rng_file.is_file():
        raise ValueError(
            f"checkpoint {path} was written by {state['world_size']} ranks and has no RNG state for rank {rank()}"
        )
    SafeCheckpointEngine.of(learner.engine)  # DeepSpeed reads its files through ours: nothing is unpickled
    load_path, _ = learner.engine.load_checkpoint(
        str(path), tag=DEEPSPEED_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if load_path is None:
        raise ValueError(f"DeepSpeed found no state under {path / DEEPSPEED_TAG}")
    learner.version = int(state["policy_version"])
    restore_rng_file(rng_file)
    heads_file = path / HEADS_FILE
    heads = HeadsState.load(heads_file) if heads_file.is_file() else None
    drafter_file = path / DRAFTER_FILE
    drafter = load_state(drafter_file) if drafter_file.is_file() else None
    history_file = path / DRAFT_HISTORY_FILE
    draft_history = load_state(history_file) if history_file.is_file() else None
    return ResumeState(
        path=path,
        step=int(state["step"]),
        policy_version=learner.version,
        data_position=state["data_position"],
        heads=heads,
        wandb_run_id=state["wandb_run_id"],
        config=state["config"],
        drafter=drafter,
        draft_history=draft_history,
    )


def policy_weights(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A checkpoint's saved config (`model`, `learner`, `run`) and the policy's weights (`policy.safetensors`,
    whole at any ZeRO stage), without a learner and without unpickling anything."""
    path = Path(path)
    verify_checkpoint(path)
    config = json.loads((path / STATE_FILE).read_text())["config"]
    if not (path / POLICY_FILE).is_file():
        raise ValueError(
            f"checkpoint {path} has no {POLICY_FILE}: it was saved before SpecRoll kept the policy's weights in "
            "safetensors, and outside a resume its pickled DeepSpeed files are not read. To convert it, resume "
            f"the run from it with this version (python -m specroll.train ... resume={path}) and use the next "
            "checkpoint it saves"
        )
    weights = load_file(path / POLICY_FILE)
    if config["model"].get("tie_word_embeddings") and "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["embed_tokens.weight"]  # saved once, under its first name
    return config, weights


def restore_rng_file(rng_file: Path) -> None:
    try:
        rng = RngState.load(rng_file)
    except UnsafeCheckpointError as exc:
        if not all(t.startswith("numpy") for t in exc.types):
            raise
        # Checkpoints from before `RngState` pickled numpy arrays; we load no pickles, so those draws start afresh.
        warnings.warn(f"{rng_file} holds RNG states in the old pickled format; not restored", stacklevel=3)
        return
    rng.restore()


def export_hf(
    model_or_state_dict: torch.nn.Module | dict[str, torch.Tensor],
    model_config: ModelConfig,
    tokenizer,
    out_dir: str | Path,
) -> Path:
    """Write a directory `transformers.AutoModelForCausalLM.from_pretrained` loads (config,
    generation config with the policy's stop tokens, weights, and the tokenizer with its chat template).

    Weights keep their dtype and get HF names (`lm_head.weight` is left out when tied).
    Written to a temporary sibling and renamed, so `out_dir` is whole or absent.
    """
    from transformers import GenerationConfig

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
        GenerationConfig.from_model_config(hf_config).save_pretrained(tmp)
        save_file(hf_state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
