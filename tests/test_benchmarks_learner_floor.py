"""The learner floor benchmark on the tiny model: the real learner, a GEMM measurement, the JSON."""
from __future__ import annotations

import json

import pytest

from specroll.benchmarks.learner_floor import main, op_category, parameter_count
from specroll.learner.phases import PHASES
from specroll.models import build_tiny_model


def test_tied_weights_count_once():
    untied, tied = build_tiny_model("llama"), build_tiny_model("qwen2")
    embedding = untied.config.vocab_size * untied.config.hidden_size
    assert parameter_count(untied) == sum(p.numel() for p in untied.parameters())
    # qwen2's tiny config ties the LM head to the embedding and adds q/k/v biases to every layer.
    c = tied.config
    biases = c.num_layers * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    assert parameter_count(tied) == parameter_count(untied) - embedding + biases


def test_operations_are_sorted_by_kind():
    vocab = 1000
    assert op_category("aten::mm", [[8, 576], [576, 1000]], vocab) == "gemm_lm_head"
    assert op_category("aten::addmm", [[1536], [8, 576], [576, 1536]], vocab) == "gemm_body"
    assert op_category("aten::logsumexp", [[2, 4, 1000], [], []], vocab) == "vocab_elementwise"
    assert op_category("aten::_scaled_dot_product_flash_attention_for_cpu", [[1, 9, 8, 64]], vocab) == "attention"
    assert op_category("aten::add", [[8, 576], [8, 576]], vocab) == "other_ops"


def test_tiny_run_writes_the_floor_fraction_and_the_breakdown(tmp_path):
    out = tmp_path / "floor.json"
    summary = main(["--model", "tiny", "--sequences", "4", "--prompt-len", "8", "--response-len", "6", "--steps", "1",
                    "--gemm-sizes", "32", "64", "--gemm-seconds", "0.01", "--threads", "1", "--json", str(out),
                    "learner.micro_batch_tokens=32"])
    written = json.loads(out.read_text())
    assert written["summary"] == summary
    assert summary["model"] == "tiny-llama" and summary["threads"] == 1 and summary["micro_batch_tokens"] == 32
    tokens = summary["tokens_per_step"]
    assert 4 * (7 + 5) <= tokens <= 4 * (8 + 6)
    assert summary["tokens_per_s"] == pytest.approx(tokens / summary["step_seconds"])
    assert summary["floor_tokens_per_s"] == pytest.approx(summary["gemm_flops"] / (6 * summary["parameters"]))
    step = written["steps"][0]
    assert set(step["gemm_flops"]) == {"32", "64"}
    assert summary["fraction_of_floor"] == pytest.approx(step["floor_seconds"] / step["seconds"])
    best_cpu_rate = max(cpu for _, cpu in step["gemm_flops"].values())
    floor_flops = 6 * summary["parameters"] * tokens
    assert summary["fraction_of_floor_cpu"] == pytest.approx(floor_flops / best_cpu_rate / step["cpu_seconds"])
    breakdown = written["breakdown"]
    assert set(breakdown["phases"]) == set(PHASES) | {"outside_phases"}
    assert set(breakdown["ops"]) == {"gemm_body", "gemm_lm_head", "attention", "vocab_elementwise", "other_ops",
                                     "outside_ops"}
    for parts in (breakdown["phases"], breakdown["ops"]):
        assert all(seconds >= 0 for seconds in parts.values())
        assert sum(parts.values()) >= breakdown["seconds"] * 0.999
    assert breakdown["phases"]["forward"] > 0 and breakdown["phases"]["backward"] > 0
    assert breakdown["ops"]["gemm_body"] > 0
    assert 0 < len(breakdown["top_ops"]) <= 12 and "aten::mm" in breakdown["top_ops"]
    assert summary["old_logprobs_from_update"] and summary["old_logprob_pass_seconds"] > 0
