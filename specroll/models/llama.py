"""Our own Llama-family forward (Llama 2/3/3.1, Qwen2/2.5, Qwen3, SmolLM2), in the style of gpt-fast.

One plain `nn.Module` serves the rollout engine (with a `KVCache`, tree masks, hidden states
for the draft heads) and the learner (full sequences, gradients). q/k/v and gate/up are fused
into one matmul each: at batch 1 a decode step is bound by weight reads and per-op overhead.
"""
from __future__ import annotations

import math
from dataclasses import asdict
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig
from .kv_cache import KVCache, LayerKV, attended, store
from .prepacked_linear import PrepackedLinear, set_prepacked

# Compiled, a region is traced and compiled once for every call (torch >= 2.8; before, a no-op).
nested_compile_region = getattr(torch.compiler, "nested_compile_region", lambda fn: fn)


class ModelOutput(NamedTuple):
    logits: torch.Tensor  # [B, K, V] at the requested positions (all T by default)
    hidden: torch.Tensor  # [B, T, D] final hidden state after the last norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like the reference implementation, so bf16 matches it.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") != "llama3":
        return inv_freq
    # Llama 3.1: low frequencies are divided by `factor`, high ones kept, the band between blended.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The cosines and signed sines [B, 1, T, D] of the rotary angles at `positions` [B, T] that
    `apply_rope` takes: the sines' first half negated, so a rotation needs no negation per layer."""
    half = inv_freq.shape[0]
    angles = positions[..., None].float() * inv_freq.repeat(2)  # [B, T, D]: each angle for both halves
    sign = torch.where(torch.arange(2 * half, device=angles.device) < half, -1.0, 1.0)
    # Compiled, one kernel makes both (a concatenation of halves is a kernel per half).
    return angles.cos().to(dtype)[:, None], (angles.sin() * sign).to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`x` [..., D] rotated by `rope_angles`: x * cos + (x's two halves swapped) * signed sin.
    Swapped by a flip, not concatenated: compiled, a concatenation is a kernel per half."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return x * cos + swapped * signed_sin


def attention_bias(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """What `grouped_masked_attention` adds to the scores where `mask` [B, 1, T, S] allows (0) or not
    (-inf), for the G = `groups` query heads that share a key/value head, attending as one head of
    G*T queries: [B, 1, G*T, S]. A forward makes it once for all its layers."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return bias.repeat(1, 1, groups, 1) if groups > 1 else bias


def grouped_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Attention of `q` [B, H, T, D] over `k`, `v` [B, KVH, S, D] plus the `attention_bias` [B, 1, G*T, S].

    The G = H / KVH query heads that share a key/value head attend as one head of G*T queries,
    so the kernel sees plain multi-head attention: masked grouped-query attention has no fused
    kernel on GPUs and falls back to ones that copy keys and values for every query head.
    """
    batch, heads, num_new, dim = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    if groups == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    # Query head h = kv * G + g reads KV head kv; its query t becomes query g * T + t of head kv.
    out = F.scaled_dot_product_attention(q.reshape(batch, kv_heads, groups * num_new, dim), k, v, attn_mask=bias)
    return out.reshape(batch, heads, num_new, dim)  # a copy where the kernel returns another layout


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = PrepackedLinear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = PrepackedLinear(q_size, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, signed_sin, layer_kv: LayerKV | None, slots, bias) -> torch.Tensor:
        batch, num_new, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(batch, num_new, self.num_heads, self.head_dim)
        k = k.view(batch, num_new, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(batch, num_new, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, signed_sin), apply_rope(k, cos, signed_sin)
        if layer_kv is not None:
            store(layer_kv, slots, k, v)
            k, v = attended(layer_kv, batch, bias.shape[-1])
        if bias is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.num_heads != self.num_kv_heads)
        else:
            out = grouped_masked_attention(q, k, v, bias)
        return self.o_proj(out.transpose(1, 2).reshape(batch, num_new, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = PrepackedLinear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = PrepackedLinear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    # Compiled, every layer runs this one region, not a copy of its own: compiling barely grows
    # with depth (a no-op when eager).
    @nested_compile_region
    def forward(self, x, update, cos, signed_sin, layer_kv, slots, bias) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer over the residual stream `x + update`: (the stream after attention, the MLP's
        output). The next layer adds that output as its `update`, in the same kernel as its norm:
        compiled regions fuse nothing across their boundary. `layer_kv`: this layer's keys and
        values in the KV cache (`KVCache.layer`), or None; `bias`: the `attention_bias` of the
        forward's mask, or None for causal attention without a cache."""
        x = x + update
        x = x + self.self_attn(self.input_layernorm(x), cos, signed_sin, layer_kv, slots, bias)
        return x, self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = PrepackedLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inverse_frequencies(cfg), persistent=False)
        # The architecture as `form` names it: neither the weights' identity nor their stop tokens.
        self.architecture = str({k: v for k, v in asdict(cfg).items() if k not in ("name", "eos_token_ids")})
        self.activation_checkpointing = False  # see `use_activation_checkpointing`

    @property
    def form(self) -> str:
        """What a compiled step's code depends on besides the weights' values (see
        `rollout.compiled_step.specialise`): the architecture, the weights' dtype and device, and
        whether linears multiply by packed weights."""
        weight = self.embed_tokens.weight
        return f"{self.architecture} {weight.dtype} {weight.device} prepacked={self.lm_head.prepacked}"

    def use_prepacked_linears(self, enabled: bool = True) -> "CausalLM":
        """Inference on CPU multiplies by prepacked weights (see `prepacked_linear`)."""
        set_prepacked(self, enabled)
        return self

    def use_activation_checkpointing(self, enabled: bool = True) -> "CausalLM":
        """Training forwards (gradients on, no KV cache) keep only each decoder layer's inputs and
        recompute the layer in backward: activation memory drops from every layer's intermediates
        to one layer's, for about one more forward of compute. Forwards with a cache or without
        gradients (rollout, compiled steps, log-probs under no_grad) never checkpoint, so `form`
        does not change."""
        self.activation_checkpointing = enabled
        return self

    def _apply(self, fn, recurse=True):
        # Rope frequencies stay float32 when the weights go to bf16 (as in transformers):
        # rounded to bf16, a token hundreds of positions in is rotated by a visibly wrong angle.
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        new_token_mask: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
        span: int | None = None,
    ) -> ModelOutput:
        """Run the decoder over `input_ids` [B, T].

        Without a cache: plain causal attention over the T tokens (training, oracle checks);
        `new_token_mask` [B, T, T] overrides causality (e.g. packed sequences).
        With a cache: the T tokens are appended after each row's cached prefix and attend to
        it plus whatever `new_token_mask` allows (default causal); the caller commits slots.
        `position_ids` default to 0..T-1 (no cache) or lengths + 0..T-1 (cache).
        `logits_at` [B, K] picks the positions whose logits are computed (saves the LM head
        on prefill and decode); hidden states are always returned for every position.
        `span` (with a cache): attend to the first `span` slots of every row, a fixed shape
        that needs no host sync; the caller guarantees every row's prefix plus T fits in it.
        """
        batch, num_new = input_ids.shape
        device, cfg = input_ids.device, self.config
        if position_ids is None:
            position_ids = torch.arange(num_new, device=device)[None].expand(batch, num_new)
            if cache is not None:
                position_ids = position_ids + cache.lengths[:batch, None]
        x = self.embed_tokens(input_ids)
        cos, signed_sin = rope_angles(position_ids, self.inv_freq, x.dtype)

        slots, mask = None, None
        if cache is not None:
            if new_token_mask is None:
                new_token_mask = torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril()
                new_token_mask = new_token_mask.expand(batch, num_new, num_new)
            slots = cache.append_slots(batch, num_new, span)
            mask = cache.attention_mask(new_token_mask, span)
        elif new_token_mask is not None:
            mask = new_token_mask[:, None]
        bias = None if mask is None else attention_bias(mask, cfg.num_heads // cfg.num_kv_heads, x.dtype)

        # `cache` first: a compiled step (always with a cache) traces neither the flag nor the checkpoint.
        recompute = cache is None and torch.is_grad_enabled() and self.activation_checkpointing
        update = torch.zeros_like(x)
        for i, layer in enumerate(self.layers):
            layer_kv = None if cache is None else cache.layer(i)
            if recompute:
                x, update = checkpoint(layer, x, update, cos, signed_sin, layer_kv, slots, bias, use_reentrant=False)
            else:
                x, update = layer(x, update, cos, signed_sin, layer_kv, slots, bias)
        hidden = self.norm(x + update)
        picked = hidden
        if logits_at is not None:
            picked = torch.gather(hidden, 1, logits_at[..., None].expand(-1, -1, hidden.shape[-1]))
        return ModelOutput(self.lm_head(picked), hidden)
