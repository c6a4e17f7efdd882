"""The GPU check script and the dtype mismatch benchmark, run on tiny models on the CPU."""
from __future__ import annotations

import json

import pytest
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
        # On a CPU both calls run the flash kernel; on a GPU masked grouped-query attention has none.
        assert timing["attention_kernels"] == {"grouped": "flash_attention", "masked_gqa": "flash_attention"}
        assert timing["cudagraph_skips"] == []  # no CUDA graphs are attempted on a CPU
    assert result["spec_vs_plain"] == {"skipped": "dry run"} and result["skipped"] == []
    # Plain decoding with each sampler, side by side at each concurrency (a tiny policy in a dry run).
    assert [row["concurrency"] for row in result["sampler_cost"]["eager"]["rows"]] == [1, 4]
    assert all(row["gumbel_tokens_s"] > 0 and row["inverse_cdf_tokens_s"] > 0 for row in result["sampler_cost"]["eager"]["rows"])

    # --models splits the check (each compiled shape takes minutes on a fresh GPU machine).
    # --profile names the ops a step spends its time in (the decoder layers' matmuls among them).
    # --attention-variants times the step's attention call beside other kernels, against its output.
    gpu_check.main(["--dry-run", "--device", "cpu", "--no-compile", "--no-spec", "--no-sampler-cost", "--models", "qwen2.5-1.5b",
                    "--profile", "--attention-variants", "--json", str(path)])
    result = json.loads(path.read_text())
    (variants,) = result["attention_variants"].values()
    assert variants["grouped_masked"]["max_abs_diff"] == 0 and variants["grouped_masked"]["kernel_us_per_call"] > 0
    assert variants["flex_masked"]["max_abs_diff"] < 0.05
    (timing,) = result["timings"]
    assert timing["case"]["model"] == "tiny-qwen2"
    top_ms = [ms for _, ms, _ in timing["top_ops"]]
    assert len(top_ms) == 30 and top_ms == sorted(top_ms, reverse=True) and min(top_ms) >= 0
    assert timing["ops_per_step"] >= sum(calls for _, ms, calls in timing["top_ops"] if ms > 0) > 0


def test_gpu_check_skips_what_would_end_past_its_time_budget(tmp_path):
    # 100 s leave room for eager runs of tiny models, not for a first compile (150 s assumed).
    path = tmp_path / "gpu_check.json"
    gpu_check.main(["--dry-run", "--device", "cpu", "--models", "smollm2", "--time-budget-s", "100",
                    "--json", str(path)])
    result = json.loads(path.read_text())
    assert [t["compiled"] for t in result["timings"]] == [False, False]
    skipped = [s["case"] if isinstance(s["case"], str) else (s["case"]["batch_size"], s["compiled"])
               for s in result["skipped"]]
    assert skipped == [(1, True), (4, True), "sampler_cost", "spec_vs_plain"]
    gpu_check.main(["--dry-run", "--device", "cpu", "--time-budget-s", "0", "--json", str(path)])
    result = json.loads(path.read_text())
    assert result["timings"] == [] and len(result["skipped"]) == 8 and result["skipped"][-1]["case"] == "spec_vs_plain"


@pytest.mark.compile
def test_gpu_check_times_runs_with_autotuned_matmuls_and_combo_kernels_beside_the_compiled_one(tmp_path):
    path = tmp_path / "gpu_check.json"
    gpu_check.main(["--dry-run", "--device", "cpu", "--no-eager", "--no-spec", "--models", "qwen2.5-1.5b",
                    "--autotune-matmuls", "--combo-kernels", "--json", str(path)])
    result = json.loads(path.read_text())
    assert result["errors"] == []
    assert [(t["compiled"], t["kind"], t["inductor_options"]) for t in result["timings"]] == [
        (True, "compiled", {}), (True, "autotuned", {"max_autotune_gemm": True}), (True, "combo", {"combo_kernels": True})]
    assert all(t["decode_ms_per_step"] > 0 for t in result["timings"])
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry-run", "--no-compile", "--combo-kernels", "--json", str(path)])


def test_cudagraph_skips_collects_the_reasons_inductor_logs_while_open():
    # Inductor's own reporting function, so a renamed logger in a later torch fails here.
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    with gpu_check.cudagraph_skips() as skips:
        log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (1 instances)")
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to cpu device")
    assert skips == ["skipping cudagraphs due to mutated inputs (1 instances)"]


def test_profile_counts_the_decoder_matmuls_of_every_step():
    # Which ops rank in the top 15 depends on the machine, so count them over every op.
    model = gpu_check.random_model({"qkv_bias": True}, torch.float32, torch.device("cpu"))
    engine = RolloutEngine(model, compile=False)
    profile = gpu_check.profile_ops(
        engine, [[1, 2, 3], [4, 5, 6]], SamplingParams(max_new_tokens=4, seed=0), torch.device("cpu"), top=10_000)
    # The matmul kernel's name depends on the CPU and dtype (oneDNN's prepacked linear or aten's).
    matmuls = sum(calls for name, _, calls in profile.top
                  if name in ("aten::addmm", "aten::mm", "mkldnn::_linear_pointwise"))
    assert matmuls >= 2 * 4  # per step: qkv, output and MLP projections of each of the 2 layers
    assert profile.ops_per_step == pytest.approx(sum(calls for _, ms, calls in profile.top if ms > 0))
    assert 0 < profile.busy_ms_per_step <= profile.span_ms_per_step


def test_busy_time_counts_overlapping_ops_once_and_span_adds_the_gaps():
    # [0, 4) and [2, 5) overlap into [0, 5); [3, 4) lies inside; [7, 9) follows a gap of 2.
    assert gpu_check.busy_and_span([(7, 9), (0, 4), (3, 4), (2, 5)]) == (7, 9)
    assert gpu_check.busy_and_span([]) == (0.0, 0.0)


def test_sampler_and_learner_agree_in_fp32_and_drift_apart_in_bf16():
    rows = {(r["rollout"], r["learner"]): r for r in logprob_mismatch.main(
        ["--policy", "tiny", "--prompts", "3", "--n", "2", "--max-new-tokens", "12"])["rows"]}
    fp32 = rows[("float32", "float32")]
    assert fp32["tokens"] > 0 and fp32["max_abs_logprob_diff"] < 1e-4 and fp32["approx_kl"] < 1e-8
    assert rows[("bfloat16", "float32")]["mean_abs_logprob_diff"] > 10 * fp32["mean_abs_logprob_diff"]
