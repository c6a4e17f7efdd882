"""Finding, converting and loading checkpoints, the conversion cache under concurrent and
damaged writes, and the errors for bad ones."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import huggingface_hub.constants
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specroll.models import (
    ModelConfig,
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


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_hf_names_round_trip(model_type):
    hf = tiny_hf_model(model_type, tie_word_embeddings=False)
    cfg = tiny_config(model_type, tie_word_embeddings=False)
    original = hf.state_dict()
    back = to_hf_state_dict(from_hf_state_dict(original, cfg), cfg)
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("option, message", [({"attention_bias": True}, "qwen3 with attention_bias"),
                                             ({"use_sliding_window": True}, "qwen3 with use_sliding_window")])
def test_qwen3_options_our_forward_lacks_are_refused(option, message):
    hf_config = tiny_config("qwen3").to_hf()
    for name, value in option.items():
        setattr(hf_config, name, value)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(hf_config)


def test_missing_tensor_is_named():
    cfg = tiny_config("llama")
    state = tiny_hf_model("llama").state_dict()
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing 1 tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        from_hf_state_dict(state, cfg)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])  # untied and tied embeddings
def test_local_directory_loads_to_the_same_logits(tmp_path, smollm2_dir, model_type):
    hf = tiny_hf_model(model_type)
    write_tiny_checkpoint(tmp_path, hf, smollm2_dir)
    model, tokenizer = load_causal_lm(str(tmp_path), dtype="float32", device="cpu")
    assert tokenizer is not None
    assert model.config.name == str(tmp_path)
    assert model.config.model_type == model_type
    assert (model.lm_head.weight is model.embed_tokens.weight) == (model_type != "llama")
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


def write_tiny_gguf(path: Path) -> Path:
    """A one-layer Llama GGUF (float32) with a byte-level BPE tokenizer: converts in about a second."""
    from gguf import GGUFWriter
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    d, ff, heads, kv = 64, 128, 4, 2
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *bytes_to_unicode().values(), "Ġt", "he"]
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1), w.add_context_length(256), w.add_embedding_length(d), w.add_feed_forward_length(ff)
    w.add_head_count(heads), w.add_head_count_kv(kv), w.add_rope_dimension_count(d // heads)
    w.add_rope_freq_base(10000.0), w.add_layer_norm_rms_eps(1e-5), w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("default"), w.add_token_list(tokens)
    w.add_token_types([3] * 3 + [1] * (len(tokens) - 3)), w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(1), w.add_eos_token_id(2), w.add_unk_token_id(0), w.add_pad_token_id(2)
    rng = np.random.default_rng(0)
    shapes = {"token_embd": (len(tokens), d), "blk.0.attn_q": (d, d), "blk.0.attn_k": (d // heads * kv, d),
              "blk.0.attn_v": (d // heads * kv, d), "blk.0.attn_output": (d, d), "blk.0.ffn_gate": (ff, d),
              "blk.0.ffn_up": (ff, d), "blk.0.ffn_down": (d, ff)}
    for name, shape in shapes.items():
        w.add_tensor(f"{name}.weight", (rng.standard_normal(shape) * 0.02).astype(np.float32))
    for name in ("blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"):
        w.add_tensor(f"{name}.weight", np.ones(d, np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


# Waits for its twin to be ready too, so that both look for the cache at the same moment and both convert.
RESOLVE_TOGETHER = textwrap.dedent("""
    import logging, sys, time
    from pathlib import Path
    import transformers  # imported before the start line: only the conversion races
    from specroll.models import resolve_checkpoint
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    gguf, me, other = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    me.touch()
    while not other.exists():
        time.sleep(0.01)
    print(resolve_checkpoint(gguf))
""")


def test_two_processes_converting_at_once_both_get_the_whole_cache(tmp_path):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    env = {**os.environ, "SPECROLL_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH")]))}
    ready = [tmp_path / "ready-a", tmp_path / "ready-b"]
    twins = [subprocess.Popen([sys.executable, "-c", RESOLVE_TOGETHER, str(gguf), str(me), str(other)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for me, other in (ready, ready[::-1])]
    results = [twin.communicate(timeout=300) for twin in twins]
    assert [twin.returncode for twin in twins] == [0, 0], [err[-2000:] for _, err in results]
    assert all(err.count("to safetensors (once;") == 1 for _, err in results)  # both converted: the race was run
    (cached,) = {out.strip() for out, _ in results}
    assert [p.name for p in Path(cached).parent.iterdir()] == [Path(cached).name]  # the loser's copy is gone
    model, _ = load_causal_lm(cached)
    assert model.config.vocab_size == 261


@pytest.mark.parametrize("file, damage", [("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:1000])),
                                          ("config.json", lambda p: p.write_text('{"model_type": "lla')),
                                          ("tokenizer.json", lambda p: p.write_bytes(b""))])
def test_a_damaged_conversion_cache_is_converted_again_with_a_warning_naming_it(tmp_path, monkeypatch, file, damage):
    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    cached = resolve_checkpoint(str(gguf))
    whole = (cached / file).read_bytes()
    damage(cached / file)  # a copy cut short, a full disk, a crash before the cache was written durably
    with pytest.warns(UserWarning, match=f"model cache {cached} is damaged: {file}"):
        assert resolve_checkpoint(str(gguf)) == cached
    assert (cached / file).read_bytes() == whole
    assert [p.name for p in cached.parent.iterdir()] == [cached.name]
    load_causal_lm(str(gguf))
