"""The FastGRPO-style drafter: one decoder layer over the policy's features (docs/algorithm.md, section 8).

EAGLE's recipe as FastGRPO uses it. An entry at position t reads the policy's final hidden
state h_t (after the last norm, the feature that LM head reads) and the embedding of the next
token x_{t+1}, and predicts the feature h_{t+1}; the policy's own LM head turns a predicted
feature into the draft distribution of x_{t+2}. One `DecoderLayer` (attention + MLP) after a
linear fusion of [h_t; e(x_{t+1})]; the attention reads the drafter's own KV cache of earlier
entries. The embedding and LM head are the policy's, read at every call and never copied, so
drafts follow weight updates. Exactness never depends on the drafter: verification decides.

Saved apart from the policy (safetensors with a JSON header), like the horizon heads.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specroll.speculation.drafting.heads import model_fingerprint

from ..models import KVCache
from ..models.llama import DecoderLayer, attention_bias, rope_angles, rope_inverse_frequencies
from ..models.prepacked_linear import PrepackedLinear, set_prepacked

FORMAT_VERSION = 1
METADATA_KEY = "specroll_fastgrpo_drafter"
SHIPPED_DRAFTERS = {"smollm2-135m-instruct": "smollm2-135m-instruct.drafter.safetensors"}


@dataclass
class DrafterMeta:
    base_model: str  # model_fingerprint of the policy the drafter was trained for
    base_model_name: str = ""  # informational: alias / path of that policy
    updates: int = 0  # online updates since pretraining
    format_version: int = FORMAT_VERSION


class FeatureDrafter(nn.Module):
    """fc([h_t; e(x_{t+1})]) -> one decoder layer -> predicted h_{t+1}, shaped like the policy's layers."""

    def __init__(self, model_config) -> None:
        super().__init__()
        cfg = model_config
        self.config = cfg
        self.fc = PrepackedLinear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.layer = DecoderLayer(cfg)  # with the drafter's own one-layer KV cache
        self.register_buffer("inv_freq", rope_inverse_frequencies(cfg), persistent=False)
        self.base_model, self.base_model_name, self.updates = model_fingerprint(cfg), cfg.name, 0

    def _apply(self, fn, recurse=True):
        # Rope frequencies stay float32 whatever the weights' dtype (as in the policy's forward).
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    def use_prepacked_linears(self, enabled: bool = True) -> "FeatureDrafter":
        set_prepacked(self, enabled)
        return self

    def new_cache(self, rows: int, max_len: int) -> KVCache:
        """The drafter's own KV cache: one layer, `rows` rows of `max_len` entries."""
        p = self.fc.weight
        return KVCache(1, rows, max_len, self.config.num_kv_heads, self.config.head_dim, p.dtype, p.device)

    def forward(self, features: torch.Tensor, token_emb: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None = None, slots: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted features [B, T, D] of entries (features [B, T, D], token_emb [B, T, D], positions [B, T]).

        Without a cache: causal attention over the T entries (training). With one: the entries'
        keys go to `slots` [B, T] and attend as `mask` [B, 1, T, S] allows (the caller's tree)."""
        x = self.fc(torch.cat((features, token_emb), dim=-1))
        cos, signed_sin = rope_angles(positions, self.inv_freq, x.dtype)
        bias = None if mask is None else attention_bias(mask, self.config.num_heads // self.config.num_kv_heads, x.dtype)
        x, update = self.layer(x, torch.zeros_like(x), cos, signed_sin, None if cache is None else cache.layer(0), slots, bias)
        return x + update

    # -- persistence ----------------------------------------------------------------------
    def meta(self) -> DrafterMeta:
        return DrafterMeta(self.base_model, self.base_model_name, self.updates)

    def save(self, path: str | Path, dtype: torch.dtype = torch.float32) -> None:
        """Write weights in `dtype` (bfloat16 halves the file; `load` casts to the policy's dtype)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(tmp), metadata={METADATA_KEY: json.dumps(asdict(self.meta()))})
        tmp.replace(path)

    @classmethod
    def for_model(cls, model, seed: int = 0) -> "FeatureDrafter":
        """An untrained drafter for `model`, on its device and dtype (weights drawn on the CPU: same seed, same drafter)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            drafter = cls(model.config)
        p = next(model.parameters())
        return drafter.to(device=p.device, dtype=p.dtype)

    @classmethod
    def from_state(cls, model, meta: dict, state: dict[str, torch.Tensor]) -> "FeatureDrafter":
        """A drafter for `model` from `asdict(drafter.meta())` and its state dict (as actors and checkpoints pass them)."""
        m = DrafterMeta(**meta)
        check_fits(m, model, "the given drafter state")
        drafter = cls.for_model(model)
        drafter.load_state_dict(state)
        drafter.base_model_name, drafter.updates = m.base_model_name, m.updates
        return drafter

    @classmethod
    def load(cls, path: str | Path, model) -> "FeatureDrafter":
        """Load a drafter saved for `model`; one made for another architecture is refused."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"drafter file not found: {path}")
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                raw = (f.metadata() or {}).get(METADATA_KEY)
            state = load_file(str(path))
        except Exception as exc:
            raise ValueError(f"corrupt drafter file {path}: {exc}") from exc
        if raw is None:
            raise ValueError(f"{path} has no FastGRPO drafter metadata")
        meta = json.loads(raw)
        if meta.get("format_version", 0) > FORMAT_VERSION:
            raise ValueError(f"{path} has drafter format {meta['format_version']}; this SpecRoll reads <= {FORMAT_VERSION}")
        return cls.from_state(model, meta, state)


def check_fits(meta: DrafterMeta, model, what: str) -> None:
    expected = model_fingerprint(model.config)
    if meta.base_model != expected:
        raise ValueError(f"{what} was made for model {meta.base_model} ({meta.base_model_name}), "
                         f"not for this policy {expected} ({model.config.name})")


def shipped_drafter(model_name: str) -> Path:
    """Path of the pretrained drafter that ships with SpecRoll for `model_name`."""
    if model_name not in SHIPPED_DRAFTERS:
        raise ValueError(f"no shipped FastGRPO drafter for {model_name!r}; shipped: {sorted(SHIPPED_DRAFTERS)}")
    path = Path(__file__).resolve().parent.parent / "assets" / "drafters" / SHIPPED_DRAFTERS[model_name]
    if not path.is_file():
        raise FileNotFoundError(f"shipped drafter for {model_name!r} is missing at {path}")
    return path


def initial_drafter(model, path: str | None) -> FeatureDrafter:
    """The drafter `path` names: "shipped" (falls back to an untrained one, with a warning, where
    none ships for this policy), a file, or None (untrained)."""
    if path == "shipped":
        try:
            return FeatureDrafter.load(shipped_drafter(model.config.name), model)
        except (ValueError, FileNotFoundError) as exc:
            warnings.warn(f"no usable shipped FastGRPO drafter ({exc}); drafting with an untrained one")
            return FeatureDrafter.for_model(model)
    if path:
        return FeatureDrafter.load(path, model)
    return FeatureDrafter.for_model(model)
