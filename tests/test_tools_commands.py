"""The head-training, drafter-pretraining and profiling commands run end to end on tiny random
policies saved with SmolLM2's tokenizer (the SFT command's run is in test_learner_sft.py)."""
from __future__ import annotations

import json

import pytest

from specroll.fastgrpo import FeatureDrafter
from specroll.learner import export_hf
from specroll.models import build_tiny_model, load_causal_lm
from specroll.speculation import HorizonHeads
from specroll.speculation.budgets.hardware_profile import HardwareProfile
from specroll.tools import pretrain_drafter, profile, train_heads

SMOLLM2_VOCAB = 49152  # prompts are SmolLM2 token ids
# Few short samples, the same for both commands, so they read one samples cache.
SAMPLES = ["--positions", "200", "--prompts-per-batch", "4", "--samples-per-prompt", "2", "--max-new-tokens", "16",
           "--heldout-every", "4", "--device", "cpu"]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, tokenizer):
    model = build_tiny_model(vocab_size=SMOLLM2_VOCAB, eos_token_ids=[2])
    return export_hf(model, model.config, tokenizer, tmp_path_factory.mktemp("policy") / "tiny")


@pytest.fixture(scope="module")
def samples_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("samples"))


@pytest.fixture(scope="module")
def trained_heads(policy_dir, samples_cache, tmp_path_factory):
    """The heads file and the summary of a one-epoch head-training run."""
    out = tmp_path_factory.mktemp("heads") / "heads.safetensors"
    summary = train_heads.main(heads_flags(policy_dir, samples_cache, out, "--epochs", "1", "--batch-positions", "64"))
    return out, summary


def heads_flags(policy_dir, samples_cache, out, *more: str) -> list[str]:
    return ["--model", str(policy_dir), "--samples-cache", samples_cache, *SAMPLES, "--draft-vocab", "32",
            "--eval-positions", "64", "--out", str(out), *more]


def test_head_training_saves_heads_and_a_summary_that_keeps_the_starting_heads_one(policy_dir, samples_cache,
                                                                                    trained_heads):
    out, trained = trained_heads
    assert trained["command"].startswith("python -m specroll.tools.train_heads --model")
    assert trained["steps"] >= 2 and trained["draft_vocab"] == 32 and trained["heldout_sequences"] > 0
    assert json.loads(out.with_suffix(".json").read_text()) == json.loads(json.dumps(trained))
    heads = HorizonHeads.load(out, load_causal_lm(policy_dir, device="cpu")[0])
    assert heads.draft_vocab.numel() == 32

    # Evaluating the saved heads in place, as the shipped heads were re-saved: the summary of the
    # heads it started from is read before they are overwritten.
    evaluated = train_heads.main(heads_flags(policy_dir, samples_cache, out, "--epochs", "0", "--init-heads", str(out)))
    assert evaluated["steps"] == 0 and evaluated["train_config"] is None
    assert evaluated["samples_cache"] == trained["samples_cache"]
    assert evaluated["init_summary"] == json.loads(json.dumps(trained))


def test_drafter_pretraining_reads_the_heads_samples_and_saves_a_drafter(policy_dir, samples_cache, trained_heads,
                                                                         tmp_path, capsys):
    out = tmp_path / "drafter.safetensors"
    capsys.readouterr()
    summary = pretrain_drafter.main(["--model", str(policy_dir), "--samples-cache", samples_cache, *SAMPLES,
                                     "--epochs", "1", "--eval-prompts", "2", "--eval-n", "1", "--eval-nodes", "4",
                                     "--eval-max-new-tokens", "8", "--save-dtype", "float32", "--out", str(out)])
    # Same sampling settings as the heads' command: its cache file, nothing sampled again.
    assert summary["samples_cache"] == trained_heads[1]["samples_cache"]
    assert "(0 batches generated" in capsys.readouterr().out
    assert summary["command"].startswith("python -m specroll.tools.pretrain_drafter --model")
    assert len(summary["train_loss"]) == 1 and len(summary["heldout_loss"]) == 2
    assert summary["check_after"]["nodes"] == 4 and summary["check_after"]["responses"] == 2
    assert json.loads(out.with_suffix(".json").read_text()) == json.loads(json.dumps(summary))
    FeatureDrafter.load(out, load_causal_lm(policy_dir, device="cpu")[0])


def test_profile_measures_the_quick_grid_and_caches_it_where_the_engine_reads_it(tokenizer, tmp_path, monkeypatch,
                                                                                capsys):
    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path / "cache"))
    model = build_tiny_model()
    model_dir = export_hf(model, model.config, tokenizer, tmp_path / "tiny")
    measured = profile.main(["--model", str(model_dir), "--device", "cpu", "--cache-len", "16", "--quick"])
    assert (len(measured.latency_s), len(measured.latency_s[0])) == (4, 5) and measured.capacity >= 1
    assert HardwareProfile.load(measured.model, "cpu", "float32", 16) == measured
    assert f"C_hw = {measured.capacity} nodes" in capsys.readouterr().out
