"""One short GPU run that measures the decode step against the hardware's floors, as JSON.

For each model shape, dtype and batch size: plain decoding eager and with the compiled step
(CUDA graphs on a GPU), decode milliseconds per step with prefill apart, against the
weight-read floor (parameter bytes / copy bandwidth) and the matmul floor (the step's FLOPs /
the best matmul throughput). Shapes: SmolLM2-135M (its weights when installed, else random
weights of its shape) at batch 1 and 32, Qwen2.5-1.5B's shape with random weights in bf16 at
batch 64. Then, where SmolLM2's weights exist, plain decoding's tokens/s with each sampler side by
side (`sampler_cost`, eager and compiled) and `spec_vs_plain` quick, eager and compiled.
Each case also names the attention kernel its decode steps run on and any reason inductor
gave for skipping CUDA graphs; `--profile` adds the costliest device ops of a step and how
many ops a step launches; `--autotune-matmuls` adds a compiled run whose matmuls inductor picks
by timing its own kernels against the vendor library's, and `--combo-kernels` one whose
independent kernels launch together (inductor's combo kernels).
On a fresh H200 each compiled shape took 1.5-2.5 minutes to compile before a model's layers
compiled once, so the whole check ran about 10 minutes. Every compiled run compiles from a fresh
dynamo state, each batch size too (inductor's on-disk cache shortens the repeats). `--models` orders and splits it, and `--time-budget-s` skips (and names in the JSON) whatever
would end past the budget. `--dry-run` runs tiny models on the CPU. `--learner` instead runs one
GRPO update of the paper's 1.5B shape and prints its peak memory against the memory planner's
(`learner_memory.py`).

    python -m specroll.benchmarks.gpu_check --json gpu_check.json
    python -m specroll.benchmarks.gpu_check --models qwen2.5-1.5b smollm2 --profile --time-budget-s 420
    python -m specroll.benchmarks.gpu_check --dry-run --json /tmp/gpu_check.json
    python -m specroll.benchmarks.gpu_check --learner --json gpu_check_learner.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from specroll.speculation import shipped_heads

from ..models import build_tiny_model, load_causal_lm, resolve_device, synchronize
from ..models.llama import attention_bias, grouped_masked_attention
from ..rollout import RolloutEngine, SamplingParams
from .floors import best_seconds, decode_step_flops, matmul_gflops, memory_bandwidth_gbs, weight_bytes_per_step
from .learner_memory import PAPER_BATCH, TINY_BATCH, learner_step_memory, paper_config

SMOLLM2 = "smollm2-135m-instruct"
MODELS = ("smollm2", "qwen2.5-1.5b")  # the shapes the check times
# Architectures as in their Hugging Face configs (random weights: the timing needs only the shape).
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                     num_kv_heads=3, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
                     rope_theta=100000.0, rms_norm_eps=1e-5)
QWEN2_5_1_5B_SHAPE = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
                          num_kv_heads=2, head_dim=128, max_position_embeddings=32768, tie_word_embeddings=True,
                          qkv_bias=True, rope_theta=1000000.0)


@dataclass
class Case:
    model: str  # a name for the shape
    dtype: str
    batch_size: int
    prompt_len: int
    new_tokens: int


@dataclass
class Timing:
    case: Case
    compiled: bool
    decode_ms_per_step: float
    decode_tokens_per_s: float
    prefill_s: float
    compile_s: float  # in the warm-up call
    weight_floor_ms: float
    matmul_floor_ms: float
    attention_kernels: dict | None = None  # the SDPA kernel a decode step's attention runs on, and masked GQA's
    top_ops: list | None = None  # with --profile: (op, ms, calls) per decode step, prefill included
    ops_per_step: float | None = None  # with --profile: device ops (GPU kernels on CUDA) per decode step
    busy_ms_per_step: float | None = None  # with --profile: device time in ops per step, prefill included
    span_ms_per_step: float | None = None  # with --profile: busy plus the gaps between ops
    cudagraph_skips: list | None = None  # why inductor ran a compiled step without CUDA graphs, if it did
    kind: str = "eager"  # a key of RUN_KINDS
    inductor_options: dict | None = None  # what the kind sets in torch._inductor.config while it compiles

    def record(self) -> dict:
        return asdict(self) | {"times_weight_floor": self.decode_ms_per_step / self.weight_floor_ms,
                               "times_matmul_floor": self.decode_ms_per_step / self.matmul_floor_ms}


# What each kind of run compiles with: None is eager; the others set these inductor options.
RUN_KINDS = {
    "eager": None,
    "compiled": {},
    # Inductor times Triton matmul templates against cuBLAS for each matmul (minutes more to compile).
    "autotuned": {"max_autotune_gemm": True},
    # Independent kernels launch as one (inductor marks this experimental): fewer launches a step.
    "combo": {"combo_kernels": True},
}


class TimeBudget:
    """Whether a run of a kind (one of RUN_KINDS, "sampler_cost" or "spec_vs_plain") would still end inside
    `seconds` from now, judged by the longest run of that kind so far; compiling kinds count at
    least `FIRST_COMPILED_S`, as compiling takes minutes on a fresh GPU machine. None: no limit."""

    FIRST_COMPILED_S = 150.0

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.started = time.perf_counter()
        self.longest = {kind: 0.0 if options is None else self.FIRST_COMPILED_S for kind, options in RUN_KINDS.items()}
        self.longest["sampler_cost"] = self.longest["spec_vs_plain"] = self.FIRST_COMPILED_S

    def exhausted(self, kind: str) -> bool:
        if self.seconds is None:
            return False
        return time.perf_counter() - self.started + self.longest[kind] > self.seconds

    def spent(self, kind: str, seconds: float) -> None:
        self.longest[kind] = max(self.longest[kind], seconds)


def random_model(shape: dict, dtype: torch.dtype, device: torch.device):
    """A model of `shape` with random weights, no stop token: every response runs to its cap."""
    return build_tiny_model("qwen2" if shape.get("qkv_bias") else "llama", seed=0, eos_token_ids=[], **shape).to(
        device=device, dtype=dtype)


def smollm2(policy: str, dtype: torch.dtype, device: torch.device, dry_run: bool):
    """SmolLM2-135M-Instruct's weights (`policy`: the alias, a GGUF file or an HF directory) if
    they load, else random ones of its shape (tiny for a dry run)."""
    if dry_run:
        return random_model({}, dtype, device), "tiny-llama"
    try:
        model, _ = load_causal_lm(policy, dtype=dtype, device=device)
        model.config.eos_token_ids = []  # time fixed-length responses
        return model, SMOLLM2
    except (FileNotFoundError, ValueError, ImportError) as exc:
        print(f"SmolLM2 weights unavailable ({exc}); random weights of its shape")
        return random_model(SMOLLM2_SHAPE, dtype, device), "smollm2-135m-shape"


class OpsProfile(NamedTuple):
    top: list  # (op, milliseconds per decode step, calls per decode step), costliest first
    ops_per_step: float  # device ops (GPU kernels on CUDA, CPU ops elsewhere) a step runs in all
    busy_ms_per_step: float  # time at least one device op ran
    span_ms_per_step: float  # from the first op's start to the last one's end: busy plus idle gaps


def busy_and_span(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(time covered by the union of the (start, end) `intervals`, last end - first start)."""
    if not intervals:
        return 0.0, 0.0
    busy, covered_to = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > covered_to:
            busy += end - max(start, covered_to)
            covered_to = end
    return busy, covered_to - min(start for start, _ in intervals)


def profile_ops(engine: RolloutEngine, prompts, params: SamplingParams, device: torch.device,
                top: int = 30) -> OpsProfile:
    """The `top` ops by self time on the device (GPU kernels on CUDA, CPU ops elsewhere) over one
    more generate call, prefill included, per decode step; how many such ops a step runs in all
    (on a GPU each costs microseconds however small); and how long the device was busy against
    the span of the call's ops: the gaps are launch latency and host work the device waited for."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU]) as prof:
        out = engine.generate(prompts, params)
        synchronize(device)
    steps = max(out.stats.steps, 1)
    key = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
    ran = sum(e.count for e in events if getattr(e, key) > 0)
    kind = DeviceType.CUDA if on_cuda else DeviceType.CPU
    busy_us, span_us = busy_and_span([(e.time_range.start, e.time_range.end) for e in prof.events()
                                      if e.device_type == kind and e.time_range.end > e.time_range.start])
    return OpsProfile([(e.key, getattr(e, key) / 1e3 / steps, e.count / steps) for e in events[:top]],
                      ran / steps, busy_us / 1e3 / steps, span_us / 1e3 / steps)


def attention_kernels(model, case: Case, device: torch.device) -> dict:
    """Which SDPA kernel a decode step's attention runs on at this case's largest span: the
    model's grouped call, and masked grouped-query attention (`enable_gqa`) for comparison."""
    from torch.nn.attention import SDPBackend

    cfg = model.config
    dtype = getattr(torch, case.dtype)
    span = case.prompt_len + case.new_tokens
    groups = cfg.num_heads // cfg.num_kv_heads
    q = torch.zeros(case.batch_size, cfg.num_heads, 1, cfg.head_dim, dtype=dtype, device=device)
    kv = torch.zeros(case.batch_size, cfg.num_kv_heads, span, cfg.head_dim, dtype=dtype, device=device)
    mask = torch.ones(case.batch_size, 1, 1, span, dtype=torch.bool, device=device)
    grouped_q = q.reshape(case.batch_size, cfg.num_kv_heads, groups, cfg.head_dim)
    names = {int(member.value): name.lower() for name, member in SDPBackend.__members__.items()}
    return {"grouped": names[torch._fused_sdp_choice(grouped_q, kv, kv, attention_bias(mask, groups, dtype))],
            "masked_gqa": names[torch._fused_sdp_choice(q, kv, kv, mask, enable_gqa=groups > 1)]}


def attention_variants(model, case: Case, device: torch.device) -> dict:
    """Microseconds per call of one decode step's attention at this case's largest span, rows
    attending to random lengths of it: the model's call (a KV head's G query heads as one head,
    with the forward's attention bias), flash attention without a mask (what an unmasked kernel
    costs; a step needs the mask) and FlexAttention (compiled, masked by a score modification),
    each with its largest difference from the model's output. `us_per_call`: calls in a loop
    (host work included); `kernel_us_per_call`: on a GPU, the same calls replayed as one CUDA
    graph, as inside a step's graph (on a CPU, the loop's time)."""
    from torch.nn.attention.flex_attention import flex_attention

    cfg = model.config
    dtype = getattr(torch, case.dtype)
    span = case.prompt_len + case.new_tokens
    q = torch.randn(case.batch_size, cfg.num_heads, 1, cfg.head_dim, device=device).to(dtype)
    k, v = (torch.randn(case.batch_size, cfg.num_kv_heads, span, cfg.head_dim, device=device).to(dtype)
            for _ in range(2))
    lengths = torch.randint(span // 2, span + 1, (case.batch_size,), device=device)
    mask = (torch.arange(span, device=device) < lengths[:, None])[:, None, None, :]
    bias = attention_bias(mask, cfg.num_heads // cfg.num_kv_heads, dtype)

    def masked_score(score, b, h, q_idx, kv_idx):
        return torch.where(mask[b, 0, q_idx, kv_idx], score, -float("inf"))

    flex = torch.compile(flex_attention, dynamic=False)
    variants = {"grouped_masked": lambda: grouped_masked_attention(q, k, v, bias),
                "gqa_flash_unmasked": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                "flex_masked": lambda: flex(q, k, v, score_mod=masked_score, enable_gqa=True)}
    reference = variants["grouped_masked"]()
    calls = 50
    result = {}
    for name, fn in variants.items():
        try:
            difference = float((fn() - reference).abs().max())
            loop_s = best_seconds(lambda: [fn() for _ in range(calls)], device, repeats=5) / calls
            result[name] = {"us_per_call": loop_s * 1e6, "max_abs_diff": difference}
            result[name]["kernel_us_per_call"] = kernel_seconds(fn, device, calls) * 1e6
        except Exception as exc:  # a variant this torch cannot run (or capture) is reported, not fatal
            result[name] = result.get(name, {}) | {"error": repr(exc)}
    return result


def kernel_seconds(fn, device: torch.device, calls: int) -> float:
    """Seconds per call of `fn`'s kernels: on a GPU, `calls` calls captured as one CUDA graph and
    replayed, so no host work sits between them; on a CPU, a loop of calls."""
    if device.type != "cuda":
        return best_seconds(lambda: [fn() for _ in range(calls)], device, repeats=5) / calls
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up before capture, as CUDA graphs require
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return best_seconds(graph.replay, device, repeats=5) / calls


# Inductor says here why it skips CUDA graphs for a graph (an artifact log, off by default:
# it does not reach the root logger, but a handler of its own sees it).
CUDAGRAPH_LOG = "torch._inductor.cudagraph_utils.__cudagraphs"


class MessageList(logging.Handler):
    """A log handler that keeps the messages of warnings and worse."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def cudagraph_skips():
    """Collects, into the yielded list, the reasons inductor gives for running a graph without
    CUDA graphs: a compiled GPU step that skips them is launch-bound however fast its kernels."""
    handler, log = MessageList(), logging.getLogger(CUDAGRAPH_LOG)
    log.addHandler(handler)
    try:
        yield handler.messages
    finally:
        log.removeHandler(handler)


def time_case(model, case: Case, kind: str, floors: dict, device: torch.device, profile: bool = False) -> Timing:
    """One run of `kind` (a key of RUN_KINDS): its own inductor options, its own graphs."""
    options = RUN_KINDS[kind]
    if options is not None:
        torch._dynamo.reset()  # as in a new process: no earlier run's graphs, nor the sizes they saw (docs/guide.md)
    with cudagraph_skips() as skips, torch._inductor.config.patch(options or {}):
        timing = time_calls(model, case, options is not None, floors, device, profile)
    timing.cudagraph_skips, timing.kind, timing.inductor_options = skips, kind, options
    return timing


def time_calls(model, case: Case, compiled: bool, floors: dict, device: torch.device, profile: bool) -> Timing:
    engine = RolloutEngine(model, compile=compiled)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (case.batch_size, case.prompt_len), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=case.new_tokens, seed=0)
    warm = engine.generate(prompts, params)  # compiles every shape the timed call meets
    synchronize(device)
    started = time.perf_counter()
    out = engine.generate(prompts, params)
    synchronize(device)
    wall = time.perf_counter() - started
    steps = out.stats.steps
    decode_s = wall - out.stats.prefill_s
    rows = sum(out.stats.active_rows_per_step) / max(steps, 1)
    context = case.prompt_len + case.new_tokens / 2
    matmul_floor_s = decode_step_flops(model, rows, context) / (floors["matmul_gflops"] * 1e9)
    weight_floor_s = weight_bytes_per_step(model) / (floors["bandwidth_gbs"] * 1e9)
    ops = profile_ops(engine, prompts, params, device) if profile else OpsProfile(None, None, None, None)
    return Timing(case, compiled, decode_s / steps * 1e3, (out.stats.tokens - case.batch_size) / decode_s,
                  out.stats.prefill_s, warm.stats.compile_s, weight_floor_s * 1e3, matmul_floor_s * 1e3,
                  attention_kernels(model, case, device), *ops)


def compile_phases(top: int = 25) -> dict:
    """Seconds spent so far in this process's costliest phases of torch.compile (tracing,
    lowering, kernel compilation, autotuning), as torch records them: where a minutes-long
    compile on a fresh GPU machine goes."""
    names, seconds = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    return dict(sorted(((n, float(s)) for n, s in zip(names, seconds)), key=lambda p: -p[1])[:top])


def measure_floors(device: torch.device, dtypes: set[str], dry_run: bool) -> dict:
    size = 256 if dry_run else 4096
    return {"bandwidth_gbs": memory_bandwidth_gbs(device, megabytes=16 if dry_run else 1024),
            "matmul_gflops_by_dtype": {d: matmul_gflops(device, getattr(torch, d), size=size) for d in dtypes}}


def sampler_cost_quick(policy: str, device: torch.device, dry_run: bool) -> dict:
    """Plain decoding's tokens/s with each sampler side by side, eager and compiled, where SmolLM2's
    weights load (a tiny random policy, eager, for a dry run)."""
    from . import sampler_cost

    if dry_run:
        return {"eager": sampler_cost.main(["--tiny", "--concurrency", "1", "4", "--max-new-tokens", "8",
                                            "--repeats", "2", "--device", str(device)])}
    try:
        load_causal_lm(policy, dtype="float32", device="cpu")
    except (FileNotFoundError, ValueError, ImportError) as exc:
        return {"skipped": f"SmolLM2 weights unavailable: {exc}"}
    common = ["--policy", policy, "--concurrency", "1", "32", "--max-new-tokens", "128", "--repeats", "3",
              "--dtype", "bfloat16" if device.type == "cuda" else "float32", "--device", str(device)]
    return {"eager": sampler_cost.main(common), "compiled": sampler_cost.main([*common, "--compile"])}


def spec_vs_plain_quick(policy: str, device: torch.device, dry_run: bool) -> dict:
    """Speculative vs plain decoding, eager and compiled, where SmolLM2's weights load."""
    from . import spec_vs_plain

    if dry_run:
        return {"skipped": "dry run"}
    try:
        load_causal_lm(policy, dtype="float32", device="cpu")
    except (FileNotFoundError, ValueError, ImportError) as exc:
        return {"skipped": f"SmolLM2 weights unavailable: {exc}"}
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    # The policy is SmolLM2 by whatever path: its shipped heads, named by file.
    return spec_vs_plain.main(["--policy", policy, "--heads", str(shipped_heads(SMOLLM2)),
                               "--concurrency", "1", "8", "32", "--grpo", "8x8", "--max-new-tokens", "128",
                               "--budget", "concurrency", "--dtype", dtype, "--device", str(device), "--compile"])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="cuda, cpu or auto")
    parser.add_argument("--json", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--dry-run", action="store_true", help="tiny models and few tokens (checks the script on a CPU)")
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    parser.add_argument("--no-eager", action="store_true", help="compiled only")
    parser.add_argument("--no-spec", action="store_true", help="skip spec_vs_plain")
    parser.add_argument("--no-sampler-cost", action="store_true", help="skip the samplers' plain decoding tokens/s")
    parser.add_argument("--profile", action="store_true", help="also record each case's costliest ops per step")
    parser.add_argument("--attention-variants", action="store_true",
                        help="also time each case's decode attention against alternative kernels")
    parser.add_argument("--autotune-matmuls", action="store_true",
                        help="also time each case compiled with inductor's matmul autotuning (minutes more to compile)")
    parser.add_argument("--combo-kernels", action="store_true",
                        help="also time each case compiled with inductor's combo kernels (independent kernels as one launch)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS,
                        help="shapes to time, in this order")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="skip (and name in the JSON) every run that would end past this many seconds, "
                             "judged by the longest run of its kind so far")
    parser.add_argument("--learner", action="store_true",
                        help="only one GRPO update step of the paper's 1.5B shape: peak memory against the planner's")
    parser.add_argument("--policy", default=SMOLLM2,
                        help="SmolLM2-135M-Instruct's weights: the alias, or a GGUF file / HF directory of them")
    args = parser.parse_args(argv)
    if args.no_compile and args.no_eager:
        parser.error("--no-compile and --no-eager leave nothing to time")
    if args.no_compile and (args.autotune_matmuls or args.combo_kernels):
        parser.error("--autotune-matmuls and --combo-kernels need compiling: drop --no-compile")
    return args


def learner_check(args, device: torch.device) -> dict:
    """`--learner`: the paper's 1.5B shape in bf16 (a tiny one in float32 for a dry run)."""
    if args.dry_run:
        cfg, dtype, batch = tiny_config_for_check(), "float32", TINY_BATCH
    else:
        cfg, dtype, batch = paper_config(), "bfloat16", PAPER_BATCH
    result = learner_step_memory(cfg, dtype, device, batch)
    print(f"learner step, {result['model']} {dtype} on {device}: {result['measured_above_weights_gib']:.2f} GiB measured "
          f"above the weights, {result['planned_above_weights_gib']:.2f} GiB planned "
          f"({result['planned_over_measured']:.2f}x)")
    args.json.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")
    return result


def tiny_config_for_check():
    from ..models import tiny_config

    # Large enough that the step, not the process's own allocations, sets the peak.
    return tiny_config("qwen2", vocab_size=8192, hidden_size=256, intermediate_size=704, num_layers=8, num_heads=8,
                       num_kv_heads=2, head_dim=32, max_position_embeddings=1024)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = resolve_device(args.device)
    if args.learner:
        return learner_check(args, device)
    bf16 = "bfloat16" if device.type == "cuda" or args.dry_run else "float32"
    small = "bfloat16" if device.type == "cuda" else "float32"
    # (case, shape) per model; tiny stand-ins for a dry run; shape None: SmolLM2's weights.
    if args.dry_run:
        by_model = {"smollm2": [(Case("tiny-llama", "float32", b, 8, 6), None) for b in (1, 4)],
                    "qwen2.5-1.5b": [(Case("tiny-qwen2", bf16, 4, 8, 6),
                                      {"qkv_bias": True, "tie_word_embeddings": True})]}
    else:
        by_model = {"smollm2": [(Case("smollm2", small, b, 128, 128), None) for b in (1, 32)],
                    "qwen2.5-1.5b": [(Case("qwen2.5-1.5b-shape", bf16, 64, 128, 128), QWEN2_5_1_5B_SHAPE)]}
    cases = [case for name in args.models for case in by_model[name]]
    floors = measure_floors(device, {c.dtype for c, _ in cases}, args.dry_run)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "floors": floors, "timings": [], "errors": [], "skipped": [],
              "attention_variants": {}}
    budget = TimeBudget(args.time_budget_s)

    def write() -> None:
        result["compile_phases_s"] = compile_phases()
        args.json.write_text(json.dumps(result, indent=1))

    models: dict[tuple, tuple] = {}
    for case, shape in cases:
        dtype = getattr(torch, case.dtype)
        key = (case.model, case.dtype)
        if key not in models:
            models[key] = (random_model(shape, dtype, device), case.model) if shape is not None else \
                smollm2(args.policy, dtype, device, args.dry_run)
        model, name = models[key]
        case.model = name
        if args.attention_variants:  # before the timings, which can take minutes to compile
            result["attention_variants"][f"{name} batch {case.batch_size}"] = variants = \
                attention_variants(model, case, device)
            print(f"attention, {name} batch {case.batch_size}: {variants}")
            write()
        case_floors = {"bandwidth_gbs": floors["bandwidth_gbs"], "matmul_gflops": floors["matmul_gflops_by_dtype"][case.dtype]}
        kinds = [kind for kind, wanted in (("eager", not args.no_eager), ("compiled", not args.no_compile),
                                           ("autotuned", args.autotune_matmuls), ("combo", args.combo_kernels)) if wanted]
        for kind in kinds:
            compiled = RUN_KINDS[kind] is not None
            if budget.exhausted(kind):
                result["skipped"].append({"case": asdict(case), "compiled": compiled, "kind": kind, "why": "time budget"})
                print(f"skipped {name} batch {case.batch_size} {kind}: time budget")
                continue
            started = time.perf_counter()
            try:
                timing = time_case(model, case, kind, case_floors, device, args.profile)
            except Exception:  # one failing case must not lose the others' measurements
                result["errors"].append({"case": asdict(case), "compiled": compiled, "kind": kind,
                                         "error": traceback.format_exc()})
                print(result["errors"][-1]["error"])
                continue
            finally:
                budget.spent(kind, time.perf_counter() - started)
            result["timings"].append(timing.record())
            print(f"{name} {case.dtype} batch {case.batch_size} {kind}: "
                  f"{timing.decode_ms_per_step:.2f} ms/step ({timing.decode_tokens_per_s:.0f} tok/s), "
                  f"{timing.decode_ms_per_step / timing.weight_floor_ms:.2f}x weight floor, "
                  f"{timing.decode_ms_per_step / timing.matmul_floor_ms:.2f}x matmul floor, compile {timing.compile_s:.0f} s")
            for reason in timing.cudagraph_skips:
                print(f"  {reason}")
            write()
    if not args.no_sampler_cost and budget.exhausted("sampler_cost"):
        result["skipped"].append({"case": "sampler_cost", "why": "time budget"})
    elif not args.no_sampler_cost:
        started = time.perf_counter()
        try:
            torch._dynamo.reset()  # its engines compile their own graphs, none with the options above
            result["sampler_cost"] = sampler_cost_quick(args.policy, device, args.dry_run)
        except Exception:
            result["errors"].append({"case": "sampler_cost", "error": traceback.format_exc()})
        budget.spent("sampler_cost", time.perf_counter() - started)
        write()
    if not args.no_spec and budget.exhausted("spec_vs_plain"):
        result["skipped"].append({"case": "spec_vs_plain", "why": "time budget"})
    elif not args.no_spec:
        try:
            torch._dynamo.reset()  # its engines compile their own graphs, none with the options above
            result["spec_vs_plain"] = spec_vs_plain_quick(args.policy, device, args.dry_run)
        except Exception:
            result["errors"].append({"case": "spec_vs_plain", "error": traceback.format_exc()})
    write()
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
