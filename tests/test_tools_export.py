"""Hugging Face models in and out: a user's tiny Llama, Qwen2 or Qwen3 directory (random, built from a
config) is the policy, is trained one step and checkpointed with draft heads; `python -m
specroll.tools.export` makes a directory that transformers loads and greedy-decodes as our engine
does, with the heads beside it, where the speculative decoder finds them."""
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from specroll.configs import ModelSection
from specroll.data import format_prompt
from specroll.learner import GRPOLearner, GRPOSamples, LearnerConfig, export_hf, save_checkpoint
from specroll.models import build_tiny_model, load_causal_lm
from specroll.rollout import PlainDecoder, RolloutEngine, SamplingParams
from specroll.speculation import HorizonHeads, SpeculationConfig, SpeculativeDecoder
from specroll.speculation.drafting.heads import heads_beside
from specroll.speculation.drafting.heads_state import HeadsState
from specroll.tools.export import main as export_main

QUESTIONS = ["What is 12 + 30?", "Tom has 5 pens and buys 7 more. How many pens?", "Name a prime number."]
NEW_TOKENS = 12


def user_model_dir(tmp_path: Path, model_type: str, tokenizer) -> Path:
    """A user's Hugging Face directory: config.json, safetensors, tokenizer and chat template."""
    model = build_tiny_model(model_type, seed=5, init_std=0.2, vocab_size=len(tokenizer),
                             eos_token_ids=[tokenizer.eos_token_id])
    return export_hf(model, model.config, tokenizer, tmp_path / f"user-{model_type}")


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_a_trained_policy_exports_to_transformers_and_decodes_as_our_engine(tmp_path, smollm2_dir, model_type):
    user_dir = user_model_dir(tmp_path, model_type, AutoTokenizer.from_pretrained(smollm2_dir))
    section = ModelSection(name=str(user_dir), device="cpu")
    model, tokenizer = section.load()
    assert model.config.model_type == model_type and tokenizer.chat_template is not None
    before = {k: v.clone() for k, v in model.state_dict().items()}
    learner = GRPOLearner(model, LearnerConfig(device="cpu", lr=1e-2, warmup_steps=0, micro_batch_tokens=256,
                                               max_response_len=16, max_seq_len=256))
    prompts = [format_prompt(tokenizer, q) for q in QUESTIONS]
    learner.update(GRPOSamples(prompts, [[11, 12, 13], [14, 15], [16]], torch.tensor([1.0, -1.0, 0.5])))
    heads = HorizonHeads.for_model(model, "path", 2)
    saved_heads = HeadsState(4, {k: v.detach().clone() for k, v in heads.state_dict().items()}, heads.meta())
    save_checkpoint(learner, tmp_path / "run" / "checkpoints", step=1, heads=saved_heads,
                    run_config={"model": asdict(section)})

    out = tmp_path / "exported"
    export_main([str(tmp_path / "run"), str(out)])
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                 "qwen3": "Qwen3ForCausalLM"}[model_type]
    assert GenerationConfig.from_pretrained(out).eos_token_id == tokenizer.eos_token_id
    assert AutoTokenizer.from_pretrained(out).chat_template == tokenizer.chat_template
    ours, ours_tokenizer = load_causal_lm(str(out))
    changed = [k for k, v in ours.state_dict().items() if k in before and not torch.equal(v, before[k])]
    assert changed, "the exported policy is the trained one, not the user's start"
    with torch.no_grad():
        ids = torch.tensor([prompts[0]])
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, rtol=0, atol=1e-4)

    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    expected = []
    for prompt in prompts:
        generated = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                pad_token_id=tokenizer.eos_token_id)
        expected.append(generated[0, len(prompt):].tolist())
    spec = SpeculationConfig(head_type="path", num_heads=2, budget="fixed", fixed_nodes=4, max_nodes=4)
    decoder = SpeculativeDecoder(ours, spec)  # heads_path "shipped": DIR.heads.safetensors beside the model
    for engine in (RolloutEngine(ours, ours_tokenizer, PlainDecoder(ours)), RolloutEngine(ours, ours_tokenizer, decoder)):
        assert engine.generate([format_prompt(ours_tokenizer, q) for q in QUESTIONS], params).token_ids == expected

    assert heads_beside(out).is_file() and decoder.heads.version == 4
    exported_heads = load_file(str(heads_beside(out)))
    assert all(torch.equal(exported_heads[k], v.float()) for k, v in saved_heads.state.items())


def test_export_refuses_a_non_empty_directory_and_a_source_without_checkpoints(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("taken")
    with pytest.raises(SystemExit, match="neither a run_dir with checkpoints nor a complete checkpoint"):
        export_main([str(tmp_path), str(tmp_path / "out")])
