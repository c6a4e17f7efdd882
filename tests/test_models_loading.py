"""Finding, converting and loading checkpoints, and the errors for bad ones."""
from __future__ import annotations

import shutil

import huggingface_hub.constants
import pytest
import torch
from transformers import AutoModelForCausalLM

from specroll.models import (
    from_hf_state_dict,
    load_causal_lm,
    resolve_checkpoint,
    resolve_dtype,
    tiny_config,
    to_hf_state_dict,
)
from specroll.models.loading import cache_root

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once, at import; set what it read as well.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def tiny_hf_model(model_type: str, **overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides).to_hf(), dtype=torch.float32).eval()


def write_tiny_checkpoint(directory, hf_model, smollm2_dir) -> None:
    """A transformers directory: config, safetensors, and (any) tokenizer."""
    hf_model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, directory / name)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_hf_names_round_trip(model_type):
    hf = tiny_hf_model(model_type, tie_word_embeddings=False)
    cfg = tiny_config(model_type, tie_word_embeddings=False)
    original = hf.state_dict()
    back = to_hf_state_dict(from_hf_state_dict(original, cfg), cfg)
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name


def test_missing_tensor_is_named():
    cfg = tiny_config("llama")
    state = tiny_hf_model("llama").state_dict()
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing 1 tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        from_hf_state_dict(state, cfg)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # untied and tied embeddings
def test_local_directory_loads_to_the_same_logits(tmp_path, smollm2_dir, model_type):
    hf = tiny_hf_model(model_type)
    write_tiny_checkpoint(tmp_path, hf, smollm2_dir)
    model, tokenizer = load_causal_lm(str(tmp_path), dtype="float32", device="cpu")
    assert tokenizer is not None
    assert model.config.name == str(tmp_path)
    assert model.config.model_type == model_type
    assert (model.lm_head.weight is model.embed_tokens.weight) == (model_type == "qwen2")
    assert not any(p.is_meta for p in model.parameters())
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, rtol=0, atol=1e-5)


def test_bf16_load_keeps_float32_rope(tmp_path, smollm2_dir):
    write_tiny_checkpoint(tmp_path, tiny_hf_model("llama"), smollm2_dir)
    model, _ = load_causal_lm(str(tmp_path), dtype="bfloat16")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.inv_freq.dtype == torch.float32


def test_unknown_hub_name_names_it(offline):
    with pytest.raises(ValueError, match="specroll-tests/no-such-model"):
        load_causal_lm("specroll-tests/no-such-model")


def test_name_that_is_no_hub_id_names_it():
    with pytest.raises(ValueError, match="not a model!"):
        resolve_checkpoint("not a model!")


def test_directory_without_config_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_causal_lm(str(tmp_path))


def test_directory_without_weights_raises(tmp_path):
    tiny_config("llama").to_hf().save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_causal_lm(str(tmp_path))


def test_corrupt_weights_file_is_named(tmp_path):
    tiny_config("llama").to_hf().save_pretrained(tmp_path)
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x07not a safetensors file" * 50)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_causal_lm(str(tmp_path))


def test_missing_gguf_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        load_causal_lm(str(tmp_path / "nothing.gguf"))


@pytest.mark.parametrize("dtype", ["float64", "fp8", "bf16"])
def test_bad_dtype_raises(dtype):
    with pytest.raises(ValueError, match=dtype):
        resolve_dtype(dtype)
    with pytest.raises(ValueError, match=dtype):
        load_causal_lm("smollm2-135m-instruct", dtype=dtype)


def test_alias_is_converted_once_into_the_cache(smollm2_dir):
    assert smollm2_dir.is_relative_to(cache_root() / "models")
    assert (smollm2_dir / "config.json").is_file()
    assert (smollm2_dir / "model.safetensors").is_file()
    stamp = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    # A second resolution reuses the cached directory instead of converting again.
    assert resolve_checkpoint("smollm2-135m-instruct") == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == stamp
