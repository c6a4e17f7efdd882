"""SFT warm start on real DeepSpeed (CPU, gloo) with tiny random models: learning, exact
packing, export, the command's cache and its input errors."""

import json

import pytest
import torch

from specroll.data import Problem
from specroll.learner import export_hf
from specroll.learner.sft_trainer import (
    SUMMARY_FILE,
    SFTConfig,
    SFTExample,
    build_examples,
    pack_first_fit,
    pack_row,
    packed_attention_mask,
    response_nll_sum,
    save_result,
    split_problems,
    train_sft,
)
from specroll.models import build_tiny_model, load_causal_lm
from specroll.tools.sft import main

SMOLLM2_VOCAB = 49152  # tiny models share SmolLM2's tokenizer, so they need its vocabulary


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy shared CI machine the
    thread pool's waiting makes each step 10-100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def toy_problems(n: int) -> list[Problem]:
    """A fixed answer template around the question's number: learnable by a tiny model."""
    return [Problem(f"Repeat the number {k}.", str(k), f"The number is {k}.\n#### {k}") for k in range(n)]


def tiny_policy(seed: int = 0):
    return build_tiny_model(seed=seed, vocab_size=SMOLLM2_VOCAB, eos_token_ids=[2])


def small_recipe(**overrides) -> SFTConfig:
    fields = dict(lr=1e-2, epochs=4, row_tokens=256, batch_tokens=512, eval_examples=8, precision="float32", device="cpu")
    fields.update(overrides)
    return SFTConfig(**fields)


def test_packed_attention_mask_is_block_diagonal_causal():
    mask = packed_attention_mask(torch.tensor([0, 0, 1, 1, 1]))
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_first_fit_packing_fills_earlier_rows_and_refuses_oversized_examples():
    assert pack_first_fit([5, 3, 4, 2, 6], [0, 1, 2, 3, 4], row_tokens=8) == [[0, 1], [2, 3], [4]]
    assert pack_first_fit([5, 4, 3], [1, 0, 2], row_tokens=8) == [[1, 2], [0]]
    with pytest.raises(ValueError, match="example 1 has 9 tokens, more than row_tokens=8"):
        pack_first_fit([5, 9], [0, 1], row_tokens=8)


def test_packed_row_loss_is_the_sum_of_per_example_losses():
    model = build_tiny_model(init_std=0.1)
    gen = torch.Generator().manual_seed(0)
    examples = [
        SFTExample(tuple(torch.randint(2, 64, (p,), generator=gen).tolist()), tuple(torch.randint(2, 64, (r,), generator=gen).tolist()))
        for p, r in [(5, 7), (1, 3), (9, 4), (3, 1)]
    ]
    row = pack_row(examples)
    assert row.num_tokens == sum(len(e) for e in examples) and row.num_targets == 15
    assert row.position_ids.tolist()[:12] == list(range(12)) and row.position_ids[12] == 0

    with torch.no_grad():
        packed = float(response_nll_sum(model, row))
        separate = 0.0
        for ex in examples:
            ids = torch.tensor(ex.prompt_ids + ex.response_ids)
            logp = model(ids[None]).logits[0].log_softmax(-1)
            p = len(ex.prompt_ids)
            separate -= sum(float(logp[p - 1 + j, token]) for j, token in enumerate(ex.response_ids))
        # Without the block mask and the position reset, examples would see each other.
        leaky = torch.nn.functional.cross_entropy(
            model(row.input_ids[None], logits_at=row.predict_at[None]).logits[0], row.targets, reduction="sum"
        )
    assert packed == pytest.approx(separate, rel=1e-5)
    assert abs(float(leaky) - separate) > 1e-3


def test_short_run_lowers_held_out_nll(tokenizer):
    problems = toy_problems(48)
    train, heldout = build_examples(tokenizer, problems[:40]), build_examples(tokenizer, problems[40:])
    assert all(e.response_ids[-1] == tokenizer.eos_token_id for e in train)
    result = train_sft(tiny_policy(), train, heldout, small_recipe(), progress=False)
    before, after = result.metrics["eval_before"], result.metrics["eval_after"]
    assert result.metrics["optimizer_steps"] >= 8
    assert before["tokens"] == after["tokens"] == sum(len(e.response_ids) for e in heldout)
    # From a near-uniform start (ln 49152 = 10.8 nats) the template makes most tokens predictable.
    assert before["nll"] > 10
    assert after["nll"] < 0.5 * before["nll"]
    assert after["entropy"] < before["entropy"] - 2
    assert after["top1_prob"] > before["top1_prob"] + 0.05
    assert result.metrics["train_loss"][-1] < result.metrics["train_loss"][0]


def test_saved_policy_loads_with_the_trained_logits(tmp_path, tokenizer):
    problems = toy_problems(12)
    result = train_sft(
        tiny_policy(),
        build_examples(tokenizer, problems[:8]),
        build_examples(tokenizer, problems[8:]),
        small_recipe(max_steps=2),
        progress=False,
    )
    out = save_result(result.module, tokenizer, {"note": "test"}, tmp_path / "sft")
    loaded, loaded_tokenizer = load_causal_lm(out)
    ids = torch.tensor([build_examples(tokenizer, problems[:1])[0].prompt_ids])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, result.module(ids).logits, rtol=0, atol=1e-5)
        # Training moved the weights: the check above compares a trained policy, not the init.
        assert not torch.allclose(tiny_policy()(ids).logits, result.module(ids).logits)
    assert loaded_tokenizer.encode("#### 42") == tokenizer.encode("#### 42")
    assert json.loads((out / SUMMARY_FILE).read_text()) == {"note": "test"}


def test_split_holds_out_the_last_problems_and_trains_on_the_first_after_the_skipped():
    problems = toy_problems(10)
    train, heldout = split_problems(problems, eval_examples=2, limit=3, skip=4)
    assert train == problems[4:7] and heldout == problems[8:]
    assert split_problems(problems, 2, None, skip=5)[0] == problems[5:8]
    with pytest.raises(ValueError, match="skip=8 leaves none of the 8 problems"):
        split_problems(problems, 2, None, skip=8)


def write_gsm8k(path, problems: list[Problem]) -> None:
    path.write_text("".join(json.dumps({"question": p.question, "answer": p.solution}) + "\n" for p in problems))


def test_command_trains_saves_and_then_reuses_the_finished_result(tmp_path, tokenizer, capsys):
    initial = export_hf(tiny_policy(), tiny_policy().config, tokenizer, tmp_path / "initial")
    data = tmp_path / "toy.jsonl"
    write_gsm8k(data, toy_problems(20))
    out = tmp_path / "sft"
    args = ["--model", str(initial), "--dataset", "gsm8k", "--data-path", str(data), "--limit", "10",
            "--eval-examples", "4", "--max-steps", "2", "--row-tokens", "256", "--batch-tokens", "512",
            "--lr", "1e-2", "--device", "cpu", "--no-progress", "--out", str(out)]
    summary = main(args)
    assert summary["optimizer_steps"] == 2 and summary["train_examples"] == 10
    assert summary["eval_after"]["nll"] < summary["eval_before"]["nll"]
    assert load_causal_lm(out)[0].config.vocab_size == SMOLLM2_VOCAB

    capsys.readouterr()
    assert main(args) == summary
    assert f"already in {out}" in capsys.readouterr().out
    with pytest.raises(FileExistsError, match="another recipe"):
        main(args[:-2] + ["--seed", "1", "--out", str(out)])


def test_bad_inputs_raise_clear_errors(tmp_path, tokenizer):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    base = ["--dataset", "gsm8k", "--out", str(tmp_path / "out"), "--no-progress"]
    with pytest.raises(ValueError, match="holds no problems"):
        main(base + ["--data-path", str(empty)])
    with pytest.raises(FileNotFoundError, match="file not found: .*missing.jsonl"):
        main(base + ["--data-path", str(tmp_path / "missing.jsonl")])
    with pytest.raises(ValueError, match="--data-path is required for gsm8k"):
        main(base)
    few = tmp_path / "few.jsonl"
    write_gsm8k(few, toy_problems(3))
    with pytest.raises(ValueError, match="holds 3 problems; more than eval_examples=64"):
        main(base + ["--data-path", str(few)])
    with pytest.raises(ValueError, match="no training examples"):
        train_sft(tiny_policy(), [], build_examples(tokenizer, toy_problems(1)), small_recipe())
    with pytest.raises(ValueError, match="batch_tokens \\(128\\) must be >= row_tokens \\(256\\)"):
        small_recipe(batch_tokens=128)
    assert not (tmp_path / "out").exists()
