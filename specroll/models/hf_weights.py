"""Translate between Hugging Face Llama/Qwen2/Qwen3 parameter names and our fused layout."""
from __future__ import annotations

import torch

from .config import ModelConfig


def from_hf_state_dict(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names (`model.layers.0.self_attn.q_proj.weight` ...) -> our fused parameters."""
    missing = []

    def take(key: str) -> torch.Tensor:
        if key not in hf:
            missing.append(key)
            return torch.empty(0)
        return hf[key]

    out = {"embed_tokens.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[f"layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(
            [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
        )
        if cfg.qkv_bias:
            out[f"layers.{i}.self_attn.qkv_proj.bias"] = torch.cat(
                [take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            )
        out[f"layers.{i}.self_attn.o_proj.weight"] = take(p + "self_attn.o_proj.weight")
        if cfg.qk_norm:
            for n in ("q_norm", "k_norm"):
                out[f"layers.{i}.self_attn.{n}.weight"] = take(p + f"self_attn.{n}.weight")
        out[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
        )
        out[f"layers.{i}.mlp.down_proj.weight"] = take(p + "mlp.down_proj.weight")
        out[f"layers.{i}.input_layernorm.weight"] = take(p + "input_layernorm.weight")
        out[f"layers.{i}.post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    else:
        out["lm_head.weight"] = take("lm_head.weight")
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")
    return out


def to_hf_state_dict(ours: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our fused parameters -> HF names (for export to a transformers directory)."""
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": ours["embed_tokens.weight"], "model.norm.weight": ours["norm.weight"]}
    for i in range(cfg.num_layers):
        p, src = f"model.layers.{i}.", f"layers.{i}."
        q, k, v = ours[src + "self_attn.qkv_proj.weight"].split((q_size, kv_size, kv_size))
        out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v})
        if cfg.qkv_bias:
            qb, kb, vb = ours[src + "self_attn.qkv_proj.bias"].split((q_size, kv_size, kv_size))
            out.update({p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb, p + "self_attn.v_proj.bias": vb})
        out[p + "self_attn.o_proj.weight"] = ours[src + "self_attn.o_proj.weight"]
        if cfg.qk_norm:
            for n in ("q_norm", "k_norm"):
                out[p + f"self_attn.{n}.weight"] = ours[src + f"self_attn.{n}.weight"]
        gate, up = ours[src + "mlp.gate_up_proj.weight"].chunk(2)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = ours[src + "mlp.down_proj.weight"]
        out[p + "input_layernorm.weight"] = ours[src + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = ours[src + "post_attention_layernorm.weight"]
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ours["lm_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}
