"""Our Llama-family forward against transformers as the oracle, on the same weights."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specroll.models import CausalLM, from_hf_state_dict, tiny_config
from specroll.models.llama import apply_rope, attention_bias, grouped_masked_attention, rope_angles, rope_inverse_frequencies

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def tiny_pair(model_type: str = "llama", seed: int = 0, init_std: float = 0.1, **overrides):
    """A random transformers model (the oracle) and our `CausalLM` holding the same weights.

    The initialisation is wider than transformers' default so attention is far from uniform,
    and the norm weights are perturbed so a norm that ignored them would be caught.
    """
    cfg = tiny_config(model_type, **overrides)
    hf_cfg = cfg.to_hf()
    hf_cfg.initializer_range = init_std
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    ours = CausalLM(cfg)
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    return hf, ours.eval()


def random_ids(vocab_size: int, batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator(torch.get_default_device()).manual_seed(seed))


@pytest.mark.parametrize(
    "model_type, overrides",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"qkv_bias": True, "num_kv_heads": 4}),
        ("qwen2", {}),
        ("qwen2", {"tie_word_embeddings": False}),
        ("qwen3", {}),
        ("qwen3", {"tie_word_embeddings": False, "head_dim": 8}),
    ],
    ids=["llama", "llama-tied", "llama-bias-mha", "qwen2", "qwen2-untied", "qwen3", "qwen3-untied-narrow-heads"],
)
def test_logits_match_transformers(model_type, overrides):
    hf, ours = tiny_pair(model_type, **overrides)
    ids = random_ids(ours.config.vocab_size, 3, 40)
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids).logits
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_untied_head_is_its_own_parameter():
    hf, ours = tiny_pair("llama", tie_word_embeddings=False)
    assert ours.lm_head.weight.data_ptr() != ours.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(ours.lm_head.weight, hf.lm_head.weight, rtol=0, atol=0)
    assert not torch.equal(ours.lm_head.weight, ours.embed_tokens.weight)


def test_llama3_rope_scaling_matches_transformers_beyond_original_context():
    overrides = dict(rope_scaling=LLAMA3_ROPE, max_position_embeddings=1024, head_dim=16, num_heads=2, num_kv_heads=1)
    hf, ours = tiny_pair("llama", **overrides)
    ids = random_ids(ours.config.vocab_size, 2, 300)
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    # The scaling must matter on these positions, or the check above proves nothing.
    unscaled = CausalLM(tiny_config("llama", **{**overrides, "rope_scaling": None}))
    unscaled.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (unscaled(ids).logits[:, 64:] - expected[:, 64:]).abs().max() > 1e-2


def test_hidden_state_is_transformers_last_hidden_state_after_final_norm():
    hf, ours = tiny_pair("qwen2")
    ids = random_ids(ours.config.vocab_size, 2, 30)
    with torch.no_grad():
        expected = hf.model(ids).last_hidden_state
        out = ours(ids)
    torch.testing.assert_close(out.hidden, expected, rtol=0, atol=1e-5)


def test_logits_at_picks_positions_of_the_full_logits():
    _, ours = tiny_pair("llama")
    ids = random_ids(ours.config.vocab_size, 2, 12)
    at = torch.tensor([[11, 0, 5], [3, 3, 7]])
    with torch.no_grad():
        full = ours(ids).logits
        picked = ours(ids, logits_at=at).logits
    torch.testing.assert_close(picked, torch.stack([full[0, at[0]], full[1, at[1]]]), rtol=0, atol=1e-6)


def test_bf16_forward_is_close_to_fp32_transformers():
    hf, ours = tiny_pair("llama")
    ids = random_ids(ours.config.vocab_size, 2, 64)
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours.to(torch.bfloat16)(ids).logits
    assert got.dtype == torch.bfloat16
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=0.1)


def test_rope_rotates_each_pair_of_halves_by_its_positions_angle():
    # Dimension i and i + D/2 form a pair rotated by angle position * inv_freq[i]: hand-worked for
    # D = 4, inv_freq (1, 1/2), position 2, so angles 2 and 1.
    cos, signed_sin = rope_angles(torch.tensor([[2]]), torch.tensor([1.0, 0.5]), torch.float32)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    c, s = torch.tensor([2.0, 1.0]).cos(), torch.tensor([2.0, 1.0]).sin()
    expected = torch.stack((x[0] * c[0] - x[2] * s[0], x[1] * c[1] - x[3] * s[1],
                            x[2] * c[0] + x[0] * s[0], x[3] * c[1] + x[1] * s[1]))
    torch.testing.assert_close(apply_rope(x, cos, signed_sin)[0, 0, 0], expected)
    # The same bits as the concatenating form of transformers' rotate_half, in bf16 too.
    for dtype in (torch.float32, torch.bfloat16):
        positions = torch.arange(7)[None]
        cos, signed_sin = rope_angles(positions, torch.rand(8), dtype)
        x = torch.randn(1, 3, 7, 16).to(dtype)
        sin = signed_sin[..., 8:].repeat(1, 1, 1, 2)  # the sines, unsigned, for both halves
        rotate_half = torch.cat((-x[..., 8:], x[..., :8]), -1)
        assert torch.equal(apply_rope(x, cos, signed_sin), x * cos + rotate_half * sin)


def test_rope_frequencies_stay_float32_in_bf16():
    ours = CausalLM(tiny_config("llama", rope_scaling=LLAMA3_ROPE, head_dim=16)).to(torch.bfloat16)
    assert ours.embed_tokens.weight.dtype == torch.bfloat16
    torch.testing.assert_close(ours.inv_freq, rope_inverse_frequencies(ours.config), rtol=0, atol=0)


def test_bf16_matches_transformers_bf16_far_into_the_context(tmp_path):
    """transformers loads bf16 weights with float32 rope frequencies; so must we."""
    overrides = dict(max_position_embeddings=2048, head_dim=16, num_heads=2, num_kv_heads=1)
    hf, ours = tiny_pair("llama", init_std=0.3, **overrides)  # peaky attention: positions matter
    hf.save_pretrained(tmp_path)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    ids = random_ids(ours.config.vocab_size, 1, 1000)
    with torch.no_grad():
        expected = hf_bf16(ids).logits.float()
        got = ours.to(torch.bfloat16)(ids).logits.float()
    torch.testing.assert_close(got, expected, rtol=0, atol=0.05)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])  # q/k/v biases; query and key norms
def test_gradients_match_transformers(model_type):
    hf, ours = tiny_pair(model_type)  # tied embeddings: with either, every kind of parameter
    hf.train()
    ours.train()
    ids = random_ids(ours.config.vocab_size, 2, 24)
    hf_loss = torch.nn.functional.cross_entropy(hf(ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss = torch.nn.functional.cross_entropy(ours(ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    hf_loss.backward()
    loss.backward()
    expected = from_hf_state_dict({n: p.grad for n, p in hf.named_parameters()}, ours.config)
    for name, p in ours.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert p.grad.abs().sum() > 0, f"{name} got a zero gradient"
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def smollm2_prompt(smollm2, gsm8k_test_questions):
    _, tokenizer = smollm2
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": gsm8k_test_questions[0]}], add_generation_prompt=True, tokenize=False
    )
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])


def test_smollm2_logits_match_transformers(smollm2, smollm2_dir, smollm2_prompt):
    model, _ = smollm2
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    # The architecture, through F.linear like transformers: a RolloutEngine made earlier in the
    # session switches the shared model to prepacked linears, whose oneDNN sums differ by ~3e-4
    # (their own agreement is tested in test_models_prepacked_linear).
    model.use_prepacked_linears(False)
    with torch.no_grad():
        expected = hf(smollm2_prompt).logits
        got = model(smollm2_prompt).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("heads, kv_heads, num_new", [(6, 2, 1), (6, 2, 5), (4, 4, 3), (9, 3, 16)])
def test_grouped_masked_attention_is_each_query_head_over_its_kv_head(heads, kv_heads, num_new):
    # The reference repeats every KV head for the query heads that share it and applies the
    # masked softmax head by head, as the grouped-query attention of transformers does.
    generator = torch.Generator().manual_seed(0)
    batch, slots, dim = 3, 11, 8
    q = torch.randn(batch, heads, num_new, dim, generator=generator)
    k, v = (torch.randn(batch, kv_heads, slots, dim, generator=generator) for _ in range(2))
    mask = torch.rand(batch, 1, num_new, slots, generator=generator) > 0.4
    mask[..., 0] = True  # every query sees at least one slot
    k_per_head, v_per_head = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = (q @ k_per_head.transpose(-1, -2)) / dim ** 0.5
    expected = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v_per_head
    bias = attention_bias(mask, heads // kv_heads, q.dtype)
    torch.testing.assert_close(grouped_masked_attention(q, k, v, bias), expected, rtol=1e-5, atol=1e-6)


def test_attention_bias_repeats_the_mask_for_each_query_head_of_a_group():
    mask = torch.tensor([[True, False, True], [True, True, False]])[None, None]  # [1, 1, T=2, S=3]
    inf = float("-inf")
    rows = [[0.0, inf, 0.0], [0.0, 0.0, inf]]
    assert torch.equal(attention_bias(mask, 2, torch.float32), torch.tensor(rows + rows)[None, None])
    assert attention_bias(mask, 1, torch.bfloat16).dtype == torch.bfloat16


def test_a_models_form_names_its_architecture_dtype_and_packing_not_its_weights():
    """`form` is what a compiled step guards on in place of the modules: equal for two models that
    differ only in their weights' values, name or stop tokens, different otherwise."""
    a = CausalLM(tiny_config("llama", name="a", eos_token_ids=[1]))
    b = CausalLM(tiny_config("llama", name="b", eos_token_ids=[2]))
    assert a.form == b.form
    assert CausalLM(tiny_config("qwen2")).form != a.form
    assert CausalLM(tiny_config("qwen3", head_dim=8)).form != CausalLM(tiny_config("llama", tie_word_embeddings=True)).form
    assert CausalLM(tiny_config("llama", rope_theta=500000.0)).form != a.form
    assert b.use_prepacked_linears().form != a.form
    assert b.use_prepacked_linears(False).form == a.form
    assert b.to(torch.bfloat16).form != a.form
