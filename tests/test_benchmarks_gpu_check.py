"""The GPU check script and the dtype mismatch benchmark, run on tiny models on the CPU."""
from __future__ import annotations

import json

from specroll.benchmarks import gpu_check, logprob_mismatch


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
    ops = {name: (ms, calls) for name, ms, calls in timing["top_ops"]}
    assert len(ops) == 15 and all(ms >= 0 and calls > 0 for ms, calls in ops.values())
    assert ops["aten::addmm"][1] >= 2  # per step: the qkv projection (with bias) of each of the 2 layers


def test_sampler_and_learner_agree_in_fp32_and_drift_apart_in_bf16():
    rows = {(r["rollout"], r["learner"]): r for r in logprob_mismatch.main(
        ["--policy", "tiny", "--prompts", "3", "--n", "2", "--max-new-tokens", "12"])["rows"]}
    fp32 = rows[("float32", "float32")]
    assert fp32["tokens"] > 0 and fp32["max_abs_logprob_diff"] < 1e-4 and fp32["approx_kl"] < 1e-8
    assert rows[("bfloat16", "float32")]["mean_abs_logprob_diff"] > 10 * fp32["mean_abs_logprob_diff"]
