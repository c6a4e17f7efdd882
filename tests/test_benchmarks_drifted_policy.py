"""The adaptation benchmark's own policy B: a tiny random policy A through the real recipe."""
import json

import pytest
import torch

from specroll.benchmarks.drifted_policy import LIMIT, SKIPPED_PROBLEMS, STEPS, build_drifted_policy
from specroll.data import load_problems
from specroll.learner import export_hf
from specroll.learner.sft_trainer import SUMMARY_FILE, problems_digest
from specroll.models import build_tiny_model, load_causal_lm

SMOLLM2_VOCAB = 49152  # the tiny policy shares SmolLM2's tokenizer


def test_policy_b_is_a_after_the_recipe_cached_with_it_and_reused(tmp_path, smollm2_dir, capsys):
    from transformers import AutoTokenizer

    a = build_tiny_model(vocab_size=SMOLLM2_VOCAB, eos_token_ids=[2])
    policy_a = export_hf(a, a.config, AutoTokenizer.from_pretrained(smollm2_dir), tmp_path / "tiny-a")
    out = build_drifted_policy(str(policy_a), device="cpu", threads=1, root=tmp_path / "sft")
    assert out == tmp_path / "sft" / f"tiny-a-synthetic{LIMIT}-{STEPS}step"
    summary = json.loads((out / SUMMARY_FILE).read_text())
    # Trained on synthetic problems after those the benchmark prompts with (the first ones).
    trained_on = load_problems("synthetic")[SKIPPED_PROBLEMS : SKIPPED_PROBLEMS + LIMIT]
    assert summary["recipe"]["train_digest"] == problems_digest(trained_on)
    assert summary["optimizer_steps"] == STEPS and "--skip" in summary["command"]
    b = load_causal_lm(out, dtype="float32", device="cpu")[0]
    assert not torch.equal(b.lm_head.weight, a.lm_head.weight)

    capsys.readouterr()
    assert build_drifted_policy(str(policy_a), device="cpu", threads=1, root=tmp_path / "sft") == out
    assert f"already in {out}" in capsys.readouterr().out
    assert not list((tmp_path / "sft").glob("*.staging"))
