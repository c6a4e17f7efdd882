"""A model's shape as the memory planner needs it, read without weights.

Each model preset of `conf/model/` ships its Hugging Face `config.json` (architecture numbers
only) under `specroll/assets/architectures/<hub id>/`, so a plan needs neither network nor
weights; a local model directory, a GGUF alias or a tiny-* model is read where it is.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from specroll.models.config import ModelConfig

ARCHITECTURES = Path(__file__).resolve().parents[1] / "assets" / "architectures"


class ModelShape(NamedTuple):
    """The numbers of a Llama-family decoder that set its memory."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool  # the LM head is the embedding matrix
    qkv_bias: bool
    qk_norm: bool  # Qwen3: a norm over each head's queries and keys

    @classmethod
    def of(cls, cfg: ModelConfig) -> "ModelShape":
        return cls(cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
                   cfg.num_kv_heads, cfg.head_dim, cfg.tie_word_embeddings, cfg.qkv_bias, cfg.qk_norm)

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """One decoder layer: fused q/k/v (and its bias), o, fused gate/up, down, two norms (four with
        the query and key norms)."""
        qkv = self.hidden * (self.q_width + 2 * self.kv_width) + (self.q_width + 2 * self.kv_width) * self.qkv_bias
        norms = 2 * self.hidden + 2 * self.head_dim * self.qk_norm
        return qkv + self.q_width * self.hidden + 3 * self.hidden * self.intermediate + norms

    @property
    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.layers * self.layer_params + self.hidden

    @property
    def largest_module_params(self) -> int:
        """The most parameters one module holds (what ZeRO-3 gathers at once): the embedding or gate/up."""
        return max(self.vocab * self.hidden, 2 * self.hidden * self.intermediate)


def shipped_architecture(name: str) -> Path | None:
    """The shipped `config.json` folder of hub model `name`, or None."""
    folder = ARCHITECTURES / name
    return folder if name and (folder / "config.json").is_file() else None


def model_shape(model) -> ModelShape:
    """The shape of the model a `ModelSection` names: a tiny-* model's (vocabulary sized to its
    tokenizer), a shipped preset's, or a local model's config (raises for a hub model not shipped
    and not in the local cache)."""
    from transformers import AutoConfig

    from specroll.models import resolve_checkpoint, tiny_config

    if model.tiny_type is not None:
        tokenizer = model.load_tokenizer()
        vocab = {} if tokenizer is None else {"vocab_size": len(tokenizer)}
        return ModelShape.of(tiny_config(model.tiny_type, **vocab))
    folder = shipped_architecture(model.name) or resolve_checkpoint(model.name)
    return ModelShape.of(ModelConfig.from_hf(AutoConfig.from_pretrained(folder)))
