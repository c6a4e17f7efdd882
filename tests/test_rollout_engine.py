"""The rollout engine: greedy parity with transformers, stop rules, output layout, stats, input checks."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specroll.models import build_tiny_model, to_hf_state_dict
from specroll.rollout import RolloutEngine, SamplingParams

EOS_IDS = (1, 2, 3)
STOP_ID = 4
PROMPTS = [[5, 9, 13], [7, 8, 20, 21, 22, 23, 24, 25], [30, 31]]


@pytest.fixture(scope="module")
def engine():
    # Three EOS ids of a 64-token vocabulary: responses end by themselves every ~20 tokens.
    return RolloutEngine(build_tiny_model("llama", seed=0, init_std=0.2, eos_token_ids=list(EOS_IDS)))


def chat_prompt(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_smollm2_greedy_equals_transformers_generate(smollm2, smollm2_dir, gsm8k_test_questions):
    model, tokenizer = smollm2
    prompts = [chat_prompt(tokenizer, q) for q in gsm8k_test_questions[:3]]
    assert len({len(p) for p in prompts}) == 3, "prompts of different lengths share the batch"
    out = RolloutEngine(model, tokenizer).generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=64))
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        expected = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=64,
            pad_token_id=tokenizer.eos_token_id,
        )[0, len(prompt):].tolist()
        # transformers stops at EOS too; both keep the EOS token.
        assert out.token_ids[i] == expected, f"prompt {i} diverges"
        assert out.finish_reasons[i] == ("stop" if expected[-1] in model.config.eos_token_ids else "length")


def test_tiny_qwen3_greedy_equals_transformers_generate():
    model = build_tiny_model("qwen3", seed=1, init_std=0.2, eos_token_ids=[1]).eval()
    hf = AutoModelForCausalLM.from_config(model.config.to_hf(), dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model.state_dict(), model.config), strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])  # tied to the embeddings, loaded with them
    out = RolloutEngine(model).generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=24))
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                               pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids[i] == expected, f"prompt {i} diverges"
    assert len(set(map(tuple, out.token_ids))) == len(PROMPTS)


def test_finish_reasons_follow_eos_stop_ids_and_the_length_cap(engine):
    params = SamplingParams(max_new_tokens=30, n=8, seed=1, stop_token_ids=(STOP_ID,))
    out = engine.generate(PROMPTS, params)
    stops = set(EOS_IDS) | {STOP_ID}
    for tokens, reason in zip(out.token_ids, out.finish_reasons):
        assert not stops & set(tokens[:-1]), "a response runs on past a stop token"
        if reason == "stop":
            assert tokens[-1] in stops
        else:
            assert reason == "length"
            assert len(tokens) == params.max_new_tokens and tokens[-1] not in stops
    # The case mix the checks above need: both stop kinds, the cap, many lengths.
    last = [t[-1] for t, r in zip(out.token_ids, out.finish_reasons) if r == "stop"]
    assert set(last) & set(EOS_IDS) and STOP_ID in last
    assert "length" in out.finish_reasons
    assert len({len(t) for t in out.token_ids}) > 5


def test_response_is_capped_by_the_context_window():
    engine = RolloutEngine(build_tiny_model("llama", seed=0, max_position_embeddings=32, eos_token_ids=[]))
    out = engine.generate([list(range(2, 30)), list(range(2, 33))], SamplingParams(max_new_tokens=10, seed=0))
    assert [len(t) for t in out.token_ids] == [4, 1]
    assert out.finish_reasons == ["length", "length"]


def test_output_is_prompt_major_with_n_per_prompt(engine):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, n=3)
    out = engine.generate(PROMPTS, greedy)
    assert len(out.token_ids) == len(out.logprobs) == len(out.finish_reasons) == 9
    for i, prompt in enumerate(PROMPTS):
        alone = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=12)).token_ids[0]
        assert out.token_ids[3 * i : 3 * i + 3] == [alone] * 3
    assert out.token_ids[0] != out.token_ids[3] != out.token_ids[6]


def test_stats_are_consistent(engine):
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=30, n=4, seed=2))
    stats = out.stats
    lengths = [len(t) for t in out.token_ids]
    assert stats.tree is None  # plain decoding verifies no trees
    assert stats.tokens == sum(lengths)
    active = stats.active_rows_per_step
    assert stats.steps == len(active) == max(lengths) - 1  # the first token comes from prefill
    assert all(a >= b for a, b in zip(active, active[1:]))
    # Step s (0-based) decodes the rows still running after s + 1 tokens.
    assert active == [sum(length > s + 1 for length in lengths) for s in range(len(active))]
    assert stats.wall_time_s > 0 and stats.tokens_per_s > 0
    assert [len(lp) for lp in out.logprobs] == lengths
    assert all(lp <= 0 for row in out.logprobs for lp in row)


@pytest.mark.parametrize(
    "prompts, match",
    [
        ([], "prompts is empty"),
        ([[5, 6], []], "prompt 1 is empty"),
        ([[5, 6], [7], [3] * 256], "prompt 2 has 256 tokens"),
        ([[5, 6], [3] * 300], "prompt 1 has 300 tokens"),
        ([[5, 64]], "prompt 0 has token ids outside the vocabulary"),
        ([[-1, 5]], "prompt 0 has token ids outside the vocabulary"),
    ],
    ids=["no-prompts", "empty-prompt", "prompt-fills-context", "prompt-over-context", "id-too-large", "negative-id"],
)
def test_bad_prompts_are_named(engine, prompts, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, SamplingParams(max_new_tokens=4))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"n": 0}, "n must be"),
    ],
)
def test_bad_sampling_params_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
