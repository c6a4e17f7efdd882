"""Tiny random Llama / Qwen2 / Qwen3 models built from a config, for fast unit tests."""
from __future__ import annotations

import torch

from .config import ModelConfig
from .llama import CausalLM


def tiny_config(model_type: str = "llama", **overrides) -> ModelConfig:
    """A 2-layer model with grouped-query attention and a small vocabulary; Qwen3's heads are wider
    than hidden / heads, as in Qwen3-0.6B, so nothing may assume they are equal."""
    fields = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16 if model_type == "qwen3" else 8,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=model_type in ("qwen2", "qwen3"),
        qkv_bias=model_type == "qwen2",
        model_type=model_type,
        eos_token_ids=[1],
        name=f"tiny-{model_type}",
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def build_tiny_model(model_type: str = "llama", seed: int = 0, init_std: float = 0.02, **overrides) -> CausalLM:
    """Random weights, reproducible by seed; a larger `init_std` gives peakier distributions."""
    cfg = tiny_config(model_type, **overrides)
    generator = torch.Generator().manual_seed(seed)
    model = CausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            # Drawn on the CPU, so a seed gives the same weights on every device.
            p.copy_(torch.randn(p.shape, generator=generator, device="cpu") * init_std)
    return model
