"""The run's one copy of the model on storage every node sees: the driver stages it, every actor reads it.

The driver resolves the model once (converting a GGUF file, downloading a hub model, or taking a
local directory) and links or copies its files into `<cache>/<entry>`, writing a manifest of
them last; the actors load from that entry and never fetch or convert on their own nodes. An
entry whose manifest still matches its source is reused; a hub model's intact entry is reused
without asking the hub again.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from specroll.storage import publish_directory

from .loading import ALIASES, HUB_ID, MODEL_FILES, discard_directory, resolve_checkpoint

MANIFEST = "staged.json"
TOKENIZER_ENTRY = "-tokenizer"  # an entry holding the tokenizer and config alone (a tiny model's tokenizer)


class ModelCacheError(OSError):
    """An actor cannot read the staged model: the message names the entry and what is wrong."""


def entry_dir(name: str, cache: Path, weights: bool = True) -> Path:
    """Where model `name` (as `model.name` takes it) is staged under `cache`."""
    slug = re.sub(r"[^\w.-]+", "_", name).strip("_.")[-80:]
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]  # "a/b" and "a_b" stay apart
    return cache / f"{slug}-{digest}{'' if weights else TOKENIZER_ENTRY}"


def is_hub_name(name: str) -> bool:
    """A name that only the hub resolves: not an alias, a .gguf file or a local path."""
    local = name.endswith(".gguf") or name.startswith(("/", ".", "~")) or Path(name).expanduser().exists()
    return name not in ALIASES and not local and HUB_ID.match(name) is not None


def staged_files(source: Path, weights: bool) -> list[Path]:
    """The files of model directory `source` that loading reads (its weights only when `weights`)."""
    files = {p for pattern in MODEL_FILES for p in source.glob(pattern) if p.is_file()}
    return sorted(p for p in files if weights or p.suffix != ".safetensors")


def manifest_of(files: list[Path], source: Path) -> dict:
    """What was staged from where: each file's size and modification time (a source changed in place shows)."""
    return {"source": str(source), "files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}}


def stage(name: str, cache: Path, weights: bool = True) -> Path:
    """Model `name` staged under `cache` (fetched or converted here first); returns its entry.

    Run by the driver alone, before any actor starts.
    """
    target = entry_dir(name, cache, weights)
    if is_hub_name(name) and entry_damage(target) is None:
        return target
    source = resolve_checkpoint(name)
    files = staged_files(source, weights)
    manifest = manifest_of(files, source)
    if entry_damage(target) is None and json.loads((target / MANIFEST).read_text()) == manifest:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".tmp-"))
    try:
        for path in files:
            link_or_copy(path.resolve(), tmp / path.name)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if target.exists():
            discard_directory(target)  # its source changed since it was staged
        publish_directory(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def link_or_copy(source: Path, target: Path) -> None:
    """A hard link where `target` shares `source`'s file system (no second copy of the weights), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def entry_damage(entry: Path) -> str | None:
    """What keeps this process from reading staged `entry` (missing, unreadable, a file cut short); None when whole."""
    try:
        listed = json.loads((entry / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"it holds no {MANIFEST} (nothing was staged there, or this node does not see the driver's storage)"
    except (OSError, ValueError, KeyError, TypeError) as exc:  # a PermissionError too
        return f"its {MANIFEST} is unreadable ({type(exc).__name__}: {exc})"
    for file_name, (size, _) in listed.items():
        path = entry / file_name
        try:
            with path.open("rb"):
                found = path.stat().st_size
        except OSError as exc:
            return f"{file_name} is unreadable ({type(exc).__name__}: {exc.strerror or exc})"
        if found != size:
            return f"{file_name} holds {found} bytes, {size} were staged"
    return None


def staged(name: str, cache: Path, weights: bool = True) -> Path:
    """The entry the driver staged for `name` under `cache`, checked readable here (in an actor)."""
    entry = entry_dir(name, cache, weights)
    problem = entry_damage(entry)
    if problem is not None:
        raise ModelCacheError(f"cannot read the staged model {entry}: {problem}; the driver stages model.name there "
                              "before any actor starts, so model.cache_dir (default <run_dir>/model_cache) must be "
                              "on storage every node sees and can read")
    return entry
