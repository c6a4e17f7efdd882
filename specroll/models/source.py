"""Where a run's policy comes from: the `model` section of its config (`ModelConfig`), and loading
what it names (weights, tokenizer, context window) on the rollout side."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specroll.config_checks import FieldError, check_choice, check_device, check_text, names_local_file, not_found, require

from .config import SUPPORTED_MODEL_TYPES
from .loading import ALIASES, DTYPES, alias_path, load_causal_lm, resolve_checkpoint, resolve_device, resolve_dtype
from .model_cache import stage, staged
from .tiny import build_tiny_model, tiny_config

TINY_PREFIX = "tiny-"


@dataclass
class ModelConfig:
    """The policy: which weights, in which precision, on which device (rollout side)."""

    # An alias (smollm2-135m-instruct), a .gguf file, a Hugging Face directory, a hub id
    # (needs network), or tiny-llama / tiny-qwen2 / tiny-qwen3: the 2-layer random model of
    # `specroll.models.build_tiny_model(<type>, seed=<run seed>)` for plumbing tests.
    name: str = "smollm2-135m-instruct"
    dtype: str = "float32"  # rollout weights: float32, bfloat16 or float16
    device: str = "auto"  # auto (CUDA when present, else CPU), cpu or cuda[:i]
    # tiny-* only: a model (as in `name`) whose tokenizer is used; the tiny vocabulary and EOS
    # then match it. null: the tiny 64-token vocabulary and no tokenizer.
    tokenizer: str | None = None
    # Where the driver stages the model's files once for every actor (GGUF converted, hub model
    # downloaded, local directory linked): a folder on storage every node sees; null: <run_dir>/model_cache
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        check_text("name", self.name)
        check_text("cache_dir", self.cache_dir, optional=True)
        check_choice("dtype", self.dtype, tuple(DTYPES))
        check_device("device", self.device)
        tiny = ", ".join(TINY_PREFIX + t for t in SUPPORTED_MODEL_TYPES)
        require(self.tiny_type is None or self.tiny_type in SUPPORTED_MODEL_TYPES, "name", self.name,
                f"one of {tiny} for a tiny model")
        require(self.tokenizer is None or self.tiny_type is not None, "tokenizer", self.tokenizer,
                f"null for {self.name!r}", why="only tiny-* models take a tokenizer; others bring their own")

    def check_files(self, field_name: str) -> None:
        """The weights (`name`) or tokenizer (`tokenizer`) this names exist here: an alias's files, a
        .gguf file, a directory with a config.json (a hub id is not looked up)."""
        name = getattr(self, field_name)
        if name is None or name.startswith(TINY_PREFIX):
            return
        if name in ALIASES:
            try:
                alias_path(name)
            except FileNotFoundError as exc:
                raise FieldError(field_name, name, "an alias whose files are on this machine", why=str(exc)) from exc
            return
        local = Path(name).expanduser()
        require(not names_local_file(name, (".gguf",)) or local.exists(), field_name, name, "an existing file",
                why=not_found(name))
        require(not local.is_dir() or (local / "config.json").is_file(), field_name, name,
                "a Hugging Face model directory", why=f"{local} has no config.json")

    @property
    def tiny_type(self) -> str | None:
        """The architecture of a tiny-* model ("llama", "qwen2", "qwen3"); None for real weights."""
        return self.name[len(TINY_PREFIX):] if self.name.startswith(TINY_PREFIX) else None

    def stage(self, cache: Path) -> None:
        """Fetch or convert the model's files (a tiny model's tokenizer alone) once, into `cache`:
        run by the driver before any actor starts."""
        if self.tiny_type is None:
            stage(self.name, cache)
        elif self.tokenizer is not None:
            stage(self.tokenizer, cache, weights=False)

    def load(self, seed: int = 0, cache: Path | None = None):
        """`(CausalLM, tokenizer or None)` as this section describes them; with `cache`, read from
        the files the driver staged there (`stage`), never fetched here."""
        if self.tiny_type is None:
            model_dir = None if cache is None else staged(self.name, cache)
            return load_causal_lm(self.name, dtype=self.dtype, device=self.device, model_dir=model_dir)
        tokenizer, sized_to_tokenizer = self.load_tokenizer(cache), {}
        if tokenizer is not None:
            eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
            sized_to_tokenizer = dict(vocab_size=len(tokenizer), eos_token_ids=eos)
        model = build_tiny_model(self.tiny_type, seed=seed, **sized_to_tokenizer)
        return model.to(device=resolve_device(self.device), dtype=resolve_dtype(self.dtype)).eval(), tokenizer

    def load_tokenizer(self, cache: Path | None = None):
        """The tokenizer alone, without the weights: the model's own, or `tokenizer`'s for a tiny
        model (None when it has none); with `cache`, from the files staged there."""
        source = self.name if self.tiny_type is None else self.tokenizer
        if source is None:
            return None
        from transformers import AutoTokenizer

        if cache is not None:
            return AutoTokenizer.from_pretrained(staged(source, cache, weights=self.tiny_type is None))
        return AutoTokenizer.from_pretrained(resolve_checkpoint(source))

    def context_length(self) -> int:
        """The model's context window in tokens, read from its config alone (no weights)."""
        if self.tiny_type is not None:
            return tiny_config(self.tiny_type).max_position_embeddings
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(resolve_checkpoint(self.name)).max_position_embeddings
