"""The GPU check script and the dtype mismatch benchmark, run on tiny models on the CPU."""
from __future__ import annotations

import json

import torch

from specroll.benchmarks import gpu_check, logprob_mismatch
from specroll.rollout import RolloutEngine, SamplingParams


def test_gpu_check_dry_run_times_every_case_against_its_floors(tmp_path):
    path = tmp_path / "gpu_check.json"
    gpu_check.main(["--dry-run", "--device", "cpu", "--no-compile", "--json", str(path)])
    result = json.loads(path.read_text())
    assert result["errors"] == []
    assert [(t["case"]["batch_size"], t["case"]["dtype"]) for t in result["timings"]] == [
        (1, "float32"), (4, "float32"), (4, "bfloat16")]
    for timing in result["timings"]:
        assert timing["decode_ms_per_step"] > 0 and timing["weight_floor_ms"] > 0 and timing["matmul_floor_ms"] > 0
        assert timing["times_weight_floor"] == timing["decode_ms_per_step"] / timing["weight_floor_ms"]
    assert result["spec_vs_plain"] == {"skipped": "dry run"}

    # --models splits the check (each compiled shape takes minutes on a fresh GPU machine).
    # --profile names the ops a step spends its time in (the decoder layers' matmuls among them).
    gpu_check.main(["--dry-run", "--device", "cpu", "--no-compile", "--no-spec", "--models", "qwen2.5-1.5b",
                    "--profile", "--json", str(path)])
    (timing,) = json.loads(path.read_text())["timings"]
    assert timing["case"]["model"] == "tiny-qwen2"
    top_ms = [ms for _, ms, _ in timing["top_ops"]]
    assert len(top_ms) == 15 and top_ms == sorted(top_ms, reverse=True) and min(top_ms) >= 0


def test_profile_counts_the_decoder_matmuls_of_every_step():
    # Which ops rank in the top 15 depends on the machine, so count them over every op.
    model = gpu_check.random_model({"qkv_bias": True}, torch.float32, torch.device("cpu"))
    engine = RolloutEngine(model, compile=False)
    ops = gpu_check.profile_ops(
        engine, [[1, 2, 3], [4, 5, 6]], SamplingParams(max_new_tokens=4, seed=0), torch.device("cpu"), top=10_000)
    # The matmul kernel's name depends on the CPU and dtype (oneDNN's prepacked linear or aten's).
    matmuls = sum(calls for name, _, calls in ops if name in ("aten::addmm", "aten::mm", "mkldnn::_linear_pointwise"))
    assert matmuls >= 2 * 4  # per step: qkv, output and MLP projections of each of the 2 layers


def test_sampler_and_learner_agree_in_fp32_and_drift_apart_in_bf16():
    rows = {(r["rollout"], r["learner"]): r for r in logprob_mismatch.main(
        ["--policy", "tiny", "--prompts", "3", "--n", "2", "--max-new-tokens", "12"])["rows"]}
    fp32 = rows[("float32", "float32")]
    assert fp32["tokens"] > 0 and fp32["max_abs_logprob_diff"] < 1e-4 and fp32["approx_kl"] < 1e-8
    assert rows[("bfloat16", "float32")]["mean_abs_logprob_diff"] > 10 * fp32["mean_abs_logprob_diff"]
