"""Architecture description of a Llama-family decoder (Llama 2/3/3.1, Qwen2/2.5, Qwen3, SmolLM2)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    """Everything our forward needs to know about a Llama-family checkpoint."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None or a dict like HF's `rope_parameters`; only "default" and "llama3" are supported.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    # Qwen2 has biases on q/k/v; Llama may have them through `attention_bias`; Qwen3 has none.
    qkv_bias: bool = False
    model_type: str = "llama"
    eos_token_ids: list[int] = field(default_factory=list)
    # Identity of the weights (alias, path or hub name): heads record it to refuse a mismatch.
    name: str = ""

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.model_type == "qwen3" and self.qkv_bias:
            raise ValueError("qwen3 with attention_bias is not supported: it also puts a bias on o_proj, which we lack")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported (default, llama3)")

    @property
    def qk_norm(self) -> bool:
        """Qwen3: each head's queries and keys are RMS-normalised (a weight of `head_dim`) before RoPE."""
        return self.model_type == "qwen3"

    @classmethod
    def from_hf(cls, hf_config: Any, name: str = "") -> "ModelConfig":
        """Translate a transformers config (5.x keeps rope settings in `rope_parameters`)."""
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        rope_theta = rope.pop("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        if rope.get("rope_type", "default") == "default":
            rope = {}
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError(f"{hf_config.model_type} with use_sliding_window is not supported (full attention only)")
        eos = hf_config.eos_token_id
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        model_type = hf_config.model_type
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=hf_config.num_attention_heads,
            num_kv_heads=hf_config.num_key_value_heads or hf_config.num_attention_heads,
            head_dim=getattr(hf_config, "head_dim", None)
            or hf_config.hidden_size // hf_config.num_attention_heads,
            max_position_embeddings=hf_config.max_position_embeddings,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=float(rope_theta),
            rope_scaling=rope or None,
            tie_word_embeddings=bool(hf_config.tie_word_embeddings),
            qkv_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            model_type=model_type,
            eos_token_ids=eos_ids,
            name=name,
        )

    def to_hf(self) -> Any:
        """The equivalent transformers config (used for export and as the test oracle)."""
        from transformers import LlamaConfig, Qwen2Config, Qwen3Config

        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        rope.update(self.rope_scaling or {})
        common = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=rope,
            tie_word_embeddings=self.tie_word_embeddings,
            eos_token_id=self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids,
        )
        if self.model_type == "qwen2":
            return Qwen2Config(**common)
        if self.model_type == "qwen3":
            return Qwen3Config(**common)
        return LlamaConfig(attention_bias=self.qkv_bias, **common)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
