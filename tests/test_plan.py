"""The memory planner: its terms against hand-worked counts, DeepSpeed's estimators and measured
CPU memory; the paper presets against 80 GiB GPUs; a run that cannot fit refused before it starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specroll.command_line import compose_train_config
from specroll.plan import model_shape, plan_memory, shipped_architecture
from specroll.plan.__main__ import main as plan_main
from specroll.plan.architecture import ModelShape
from specroll.plan.terms import activations, cache_shape, kv_cache, layer_backward, logits, model_states

PRESETS = ("paper_gsm8k_qwen2_5_1_5b", "paper_qwen2_5_1_5b", "paper_qwen2_5_3b", "paper_qwen2_5_7b",
           "paper_llama3_1_8b", "paper_qwen2_5_14b", "paper_qwen2_5_14b_2node")
DATA = ("gsm8k", "math_level3to5", "dapo_math")
SHIPPED = ("Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-3B-Instruct", "Qwen/Qwen2.5-7B-Instruct",
           "Qwen/Qwen2.5-14B-Instruct", "meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen3-1.7B")
# hidden 4, intermediate 8, 2 layers, 2 query heads of 2 over 1 KV head, vocabulary 16
SMALL = ModelShape(vocab=16, hidden=4, intermediate=8, layers=2, heads=2, kv_heads=1, head_dim=2, tied=True,
                   qkv_bias=False, qk_norm=False)


def config(*overrides: str):
    return compose_train_config(list(overrides))


def test_model_states_by_hand():
    # bf16, ZeRO-2 over 4: 2P weights; 2P/4 bf16 + 4P/4 fp32 gradients; 12P/4 fp32 master + moments
    assert model_states(1000, 100, 2, 4, 2) == (2000, 1500, 3000)
    # ZeRO-3 also shards the weights and holds the gathered module (100 params) whole
    assert model_states(1000, 100, 3, 4, 2) == (700, 1200, 3000)
    # float32 ZeRO-0: weights, gradients, two moments, nothing sharded
    assert model_states(1000, 100, 0, 4, 4) == (4000, 4000, 8000)


def test_activation_logit_and_cache_terms_by_hand():
    # per token and layer in bf16: norms 2 x (4 + 4) x 4 = 64, attention 2 x (5x4 + 4x2) + 4 x 2 = 64,
    # MLP 4 x 2 x 8 = 64: 192; the final norm 32
    assert activations(SMALL, 10, 2, checkpointing=False) == 10 * (2 * 192 + 32)
    # checkpointing keeps each layer's two inputs (2 x 4 x 2 bytes)
    assert activations(SMALL, 10, 2, checkpointing=True) == 10 * (2 * 16 + 32)
    # one layer's backward: gradients 2 x (3 x 8 + 2 x 4) = 64, plus its recomputation (192)
    assert layer_backward(SMALL, 10, 2, checkpointing=True) == 10 * (192 + 64)
    # bf16 logits, their float32 copy and probabilities (or gradient): 10 bytes per entry
    assert logits(10, 16, 2) == 10 * 16 * 10
    assert cache_shape(128, 2064) == (129, 2113)
    assert kv_cache(SMALL, 3, 65, 2) == 2 * 2 * 3 * 65 * 2 * 2


def test_query_and_key_norms_by_hand():
    qwen3 = SMALL._replace(qk_norm=True)
    # a weight of head_dim 2 for each of the two norms, in each of the 2 layers
    assert qwen3.params - SMALL.params == 2 * 2 * 2
    # each norm keeps its float32 input, normalised value and output (bf16) over q (4) and k (2)
    assert activations(qwen3, 10, 2, checkpointing=False) - activations(SMALL, 10, 2, checkpointing=False) == (
        10 * 2 * (4 + 2 * 2) * (4 + 2))


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_architectures_count_the_published_parameters(name):
    from transformers import AutoConfig
    published = {"Qwen/Qwen2.5-1.5B-Instruct": 1.54e9, "Qwen/Qwen2.5-3B-Instruct": 3.09e9,
                 "Qwen/Qwen2.5-7B-Instruct": 7.62e9, "Qwen/Qwen2.5-14B-Instruct": 14.77e9,
                 "meta-llama/Llama-3.1-8B-Instruct": 8.03e9, "Qwen/Qwen3-1.7B": 2.03e9}
    # The hub counts what the safetensors hold; Qwen3-1.7B's hold its tied LM head a second time.
    stored_head = {"Qwen/Qwen3-1.7B"}
    folder = shipped_architecture(name)
    assert folder is not None and AutoConfig.from_pretrained(folder).model_type in ("qwen2", "llama", "qwen3")
    shape = model_shape(config(f"model.name={name}").model)
    stored = shape.params + (shape.vocab * shape.hidden if name in stored_head else 0)
    assert stored == pytest.approx(published[name], rel=0.005)


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("world", [4, 8, 16])
def test_model_states_match_deepspeeds_estimators(name, world):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    shape = model_shape(config(f"model.name={name}").model)
    p, largest = shape.params, shape.largest_module_params
    _, zero2 = estimate_zero2_model_states_mem_needs(p, num_gpus_per_node=world, cpu_offload=False)
    _, zero3, _ = estimate_zero3_model_states_mem_needs(p, largest, num_gpus_per_node=world, cpu_offload=False,
                                                        cpu_offload_params=False)
    assert sum(model_states(p, largest, 2, world, 2)) == pytest.approx(zero2, rel=0.05)
    assert sum(model_states(p, largest, 3, world, 2)) == pytest.approx(zero3, rel=0.05)


MEASURE = """
import json, sys, torch
from specroll.benchmarks.gpu_check import tiny_config_for_check
from specroll.benchmarks.learner_memory import TINY_BATCH, learner_step_memory
dtype, checkpointing = json.loads(sys.argv[1])
print(json.dumps(learner_step_memory(tiny_config_for_check(), dtype, torch.device("cpu"), TINY_BATCH, checkpointing)))
"""
HONEST_RSS = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "2"}


# float32 with checkpointing: gpu_check's dry run below.
@pytest.mark.parametrize("dtype,checkpointing", [("bfloat16", True), ("bfloat16", False)])
def test_planned_learner_step_matches_measured_cpu_memory(dtype, checkpointing):
    """Peak RSS of a fresh process over its second plain-torch GRPO step (8 layers, 4096 tokens), less
    its RSS before (the weights); glibc maps every allocation over 64 KiB, so RSS follows what torch holds."""
    out = subprocess.run([sys.executable, "-c", MEASURE, json.dumps([dtype, checkpointing])],
                         env={**os.environ, **HONEST_RSS}, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["planned_above_weights_gib"] == pytest.approx(result["measured_above_weights_gib"], rel=0.2)


def test_gpu_check_learner_runs_on_a_cpu_and_writes_its_json(tmp_path: Path):
    out = tmp_path / "learner.json"
    subprocess.run([sys.executable, "-m", "specroll.benchmarks.gpu_check", "--learner", "--dry-run", "--device", "cpu",
                    "--json", str(out)], env={**os.environ, **HONEST_RSS}, check=True, capture_output=True)
    result = json.loads(out.read_text())
    assert result["activation_checkpointing"] and result["cpu_rss_honest"]
    assert 0.8 <= result["planned_over_measured"] <= 1.25
    assert set(result["planned_terms_gib"]) == {"weights", "gradients", "optimizer states", "activations", "backward peak"}


GENERATE = """
import json, sys, torch
from specroll.benchmarks.gpu_check import tiny_config_for_check
from specroll.benchmarks.process_memory import peak_resident_bytes, reset_peak, resident_bytes
from specroll.models import CausalLM, load_causal_lm
from specroll.rollout import RolloutEngine, SamplingParams
which, prompts, prompt_len, n, new = json.loads(sys.argv[1])
if which == "tiny":
    torch.manual_seed(0)
    model = CausalLM(tiny_config_for_check())
else:
    model, _ = load_causal_lm(which, dtype="float32", device="cpu")
model.config.eos_token_ids = []  # every response runs to its cap
engine = RolloutEngine(model)
ids = [[(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(prompts)]
# A first call packs the CPU linears (a copy GPUs never make); its cache is dropped.
engine.generate(ids[:1], SamplingParams(max_new_tokens=2, n=2, seed=0))
engine.cache = None
reset_peak()  # the peak starts again here, past imports and the first call
before = resident_bytes()
engine.generate(ids, SamplingParams(max_new_tokens=new, n=n, seed=0))
print(peak_resident_bytes() - before)
"""


def planned_generate(shape: ModelShape, prompts: int, prompt_len: int, n: int, new: int) -> float:
    """The planner's rollout terms above the weights for one plain generate call in float32."""
    from specroll.plan.terms import decode_step, prefill
    rows, slots = cache_shape(prompts * n, prompt_len + new + 1)
    return kv_cache(shape, rows, slots, 4) + max(decode_step(shape, rows, 1, slots, 4),
                                                  prefill(shape, prompts, prompt_len, slots, 4))


def measured_generate(which: str, *sizes: int) -> int:
    out = subprocess.run([sys.executable, "-c", GENERATE, json.dumps([which, *sizes])],
                         env={**os.environ, **HONEST_RSS}, capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_planned_rollout_generate_matches_measured_cpu_memory():
    from specroll.benchmarks.gpu_check import tiny_config_for_check
    sizes = (4, 64, 8, 256)  # prompts, prompt length, responses per prompt, new tokens
    planned = planned_generate(ModelShape.of(tiny_config_for_check()), *sizes)
    assert planned == pytest.approx(measured_generate("tiny", *sizes), rel=0.2)


@pytest.mark.smollm2
def test_planned_smollm2_generate_matches_measured_cpu_memory():
    sizes = (2, 64, 8, 128)
    shape = model_shape(config("model=smollm2_135m").model)
    assert planned_generate(shape, *sizes) == pytest.approx(measured_generate("smollm2-135m-instruct", *sizes), rel=0.2)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("data", DATA)
def test_paper_presets_fit_80_gib(preset, data):
    cfg = config(f"experiment={preset}", f"data={data}")
    assert cfg.cluster.gpu_memory_gb == 80
    plan = plan_memory(cfg, model_shape(cfg.model))
    assert plan.fits and len(plan.gpus) == (16 if preset.endswith("2node") else 8)


def test_paper_preset_on_smaller_gpus_is_refused_naming_the_largest_term_and_the_fix(capsys):
    # 38.2 GiB per learner GPU with checkpointing: 40 GiB fits (margin 1.8), 32 does not
    assert plan_main(["experiment=paper_gsm8k_qwen2_5_1_5b", "cluster.gpu_memory_gb=40"]) == 0
    assert plan_main(["experiment=paper_gsm8k_qwen2_5_1_5b", "cluster.gpu_memory_gb=32"]) == 1
    err = capsys.readouterr().err
    assert "learner rank 0's logits + grad (fp32)" in err and "set learner.micro_batch_tokens=8192" in err
    assert plan_main(["experiment=paper_gsm8k_qwen2_5_1_5b", "cluster.gpu_memory_gb=40",
                      "learner.activation_checkpointing=false"]) == 1
    assert "learner rank 0's activations" in capsys.readouterr().err


def test_weight_sync_terms_by_hand():
    shape = model_shape(config("experiment=paper_qwen2_5_14b").model)

    def sync_terms(*overrides):
        plan = plan_memory(config("experiment=paper_qwen2_5_14b", *overrides), shape)
        by_kind = {actor.kind: actor for actor in plan.actors}
        return [[t.bytes for t in by_kind[kind].terms if t.name == "weight sync"]
                for kind in ("learner rank", "rollout actor")], plan

    embedding = shape.vocab * shape.hidden * 2  # bf16: the largest tensor, larger than a 256 MiB bucket, goes alone
    # collective: one bucket to send (replica dtype) and, under ZeRO-3, one bucket's parameters gathered; one received
    (learner, rollout), plan = sync_terms()
    assert learner == [2 * embedding] and rollout == [embedding] and plan.object_store == 0
    # object store: ZeRO-3 gathers the whole policy on every learner rank (6 ranks); the object itself is host memory
    (learner, rollout), plan = sync_terms("cluster.weight_sync=object_store")
    assert learner == [shape.params * 2 * (1 - 1 / 6)] and rollout == [] and plan.object_store == shape.params * 2


def test_preflight_refuses_a_run_that_cannot_fit(tmp_path: Path):
    from specroll.preflight import PreflightError, preflight
    tiny = ("model=tiny", "model.tokenizer=null", "rollout.max_new_tokens=64", "learner.max_response_len=128",
            "learner.max_seq_len=192", f"run_dir={tmp_path}")
    cfg = config(*tiny, "cluster.gpus_per_learner=1",
                 "cluster.gpu_memory_gb=1")
    with pytest.raises(PreflightError, match=r"cluster.gpu_memory_gb: the run needs .* GiB on GPU 0 \(learner rank 0\)"):
        preflight(cfg)
    preflight(config(*tiny))  # null: no check


def test_gpu_memory_gb_is_validated():
    with pytest.raises(ValueError, match="gpu_memory_gb"):
        config("cluster.gpu_memory_gb=0")
