"""Llama-family models with our own forward and KV cache."""
from .config import ModelArchitecture
from .hf_weights import from_hf_state_dict, to_hf_state_dict
from .kv_cache import KVCache
from .llama import CausalLM, ModelOutput
from .loading import load_causal_lm, resolve_checkpoint, resolve_device, resolve_dtype, synchronize
from .source import TINY_PREFIX, ModelConfig
from .tiny import build_tiny_model, tiny_config

__all__ = [
    "CausalLM",
    "KVCache",
    "ModelArchitecture",
    "ModelConfig",
    "ModelOutput",
    "TINY_PREFIX",
    "build_tiny_model",
    "from_hf_state_dict",
    "load_causal_lm",
    "resolve_checkpoint",
    "resolve_device",
    "resolve_dtype",
    "synchronize",
    "tiny_config",
    "to_hf_state_dict",
]
