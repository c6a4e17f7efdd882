"""Vanilla rollout engine vs transformers `generate` on SmolLM2-135M-Instruct.

Both sample with the same settings (temperature 1, top_p 1, no top-k, same max_new_tokens)
from the same GSM8K test prompts, and run alternately (ours, hf, ours, hf, ...) after a
warm-up, so drifting machine load hits both alike. Throughput counts generated tokens up to
and including EOS, never padding: tokens/s = generated tokens / wall time of the call.

At batch 1 a decode step cannot be faster than reading every weight once, so the measured
step time is also compared with that floor: parameter bytes / measured memory bandwidth. At
the largest batch it is compared with the matmul floor: the step's FLOPs / the best measured
matmul throughput in the same dtype. Both use decode steps alone (prefill reported apart).
`--compile` adds our engine with the compiled decode step, run alongside the eager one;
`--dtype bfloat16` runs every system in bf16 (fast on CPUs with AMX or AVX-512 BF16), and
`--dtype float32 bfloat16` runs both dtypes alternately and prints bf16's speed over fp32.

    python -m specroll.benchmarks.engine_vs_hf --batch-sizes 1 8 32 --max-new-tokens 128 --compile --json out.json
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..data import SyntheticConfig, format_prompt, generate_synthetic, load_gsm8k
from ..models import load_causal_lm, resolve_checkpoint, resolve_device, synchronize
from ..models.loading import DTYPES
from ..rollout import GenerationStats, RolloutEngine, SamplingParams
from .floors import decode_step_flops, matmul_gflops, memory_bandwidth_gbs, weight_bytes_per_step

MODEL = "smollm2-135m-instruct"
DEFAULT_GSM8K = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k" / "test.jsonl"
WARMUP_TOKENS = 8


SYSTEMS = ("ours", "compiled", "hf")  # our engine eager, our engine with the compiled step, transformers


@dataclass
class TimedBatch:
    """One system generating one batch of prompts, timed: a "run" of the JSON's `runs`."""

    system: str  # one of SYSTEMS
    batch_size: int
    repeat: int
    tokens: int  # generated tokens up to and including EOS, summed over the batch
    wall_s: float
    steps: int  # decode steps: the longest response
    prefill_s: float | None = None  # ours: prompt prefill and the first token, inside wall_s
    live_rows: float | None = None  # ours: mean unfinished rows per decode step
    dtype: str = "float32"  # of the weights and activations

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def run_record(run: TimedBatch) -> dict:
    return asdict(run) | {"tokens_per_s": run.tokens_per_s}


def load_prompts(tokenizer, count: int, gsm8k_path: Path) -> tuple[list[list[int]], str]:
    """The first `count` GSM8K test questions as chat prompts; synthetic problems without the file."""
    if gsm8k_path.is_file():
        problems, source = load_gsm8k(str(gsm8k_path), limit=count), str(gsm8k_path)
    else:
        problems, source = generate_synthetic(SyntheticConfig(num_problems=count)), "synthetic"
    return [format_prompt(tokenizer, p.question) for p in problems], source


def sampling_params(max_new_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens, seed=seed)


def run_ours(engine: RolloutEngine, prompts, max_new_tokens: int, seed: int,
             device) -> tuple[int, float, int, GenerationStats]:
    synchronize(device)
    started = time.perf_counter()
    out = engine.generate(prompts, sampling_params(max_new_tokens, seed))
    synchronize(device)
    wall = time.perf_counter() - started
    lengths = [len(t) for t in out.token_ids]
    return sum(lengths), wall, max(lengths), out.stats


def response_length(tokens: list[int], eos_ids: set[int]) -> int:
    """Tokens up to and including the first EOS; what follows it in a batch is padding."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return i + 1
    return len(tokens)


def run_hf(hf_model, prompts, max_new_tokens: int, seed: int, device, eos_ids: list[int], pad_id: int):
    # Left padding with an attention mask: how batched generation is done with transformers.
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    params = sampling_params(max_new_tokens, seed)
    torch.manual_seed(seed)
    synchronize(device)
    started = time.perf_counter()
    out = hf_model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_new_tokens=params.max_new_tokens,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
    )
    synchronize(device)
    wall = time.perf_counter() - started
    new = out[:, width:].tolist()
    return sum(response_length(row, set(eos_ids)) for row in new), wall, len(new[0]), None


def profile_batch_one(engine: RolloutEngine, prompt: list[int], max_new_tokens: int, top: int = 15) -> str:
    """The ops a batch-1 rollout spends its time in, by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        engine.generate([prompt], sampling_params(max_new_tokens, seed=0))
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def summarise(runs: list[TimedBatch], batch_sizes: list[int], systems: list[str]) -> list[dict]:
    rows = []
    for b in batch_sizes:
        row = {"batch_size": b}
        for system in systems:
            mine = [r for r in runs if r.batch_size == b and r.system == system]
            row[f"{system}_tok_s"] = sum(r.tokens for r in mine) / sum(r.wall_s for r in mine)
        row["ratio"] = row["ours_tok_s"] / row["hf_tok_s"]
        if "compiled" in systems:
            row["compiled_ratio"] = row["compiled_tok_s"] / row["hf_tok_s"]
        rows.append(row)
    return rows


def step_seconds(runs: list[TimedBatch], system: str) -> float:
    """Wall time per emitted token at batch 1, i.e. per step (prefill amortised in)."""
    mine = [r for r in runs if r.batch_size == 1 and r.system == system]
    return sum(r.wall_s for r in mine) / sum(r.tokens for r in mine)


def decode_step_seconds(runs: list[TimedBatch], batch_size: int, system: str) -> tuple[float, float, float]:
    """Ours at `batch_size`: (seconds per decode step, prefill seconds per call, mean live rows)."""
    mine = [r for r in runs if r.batch_size == batch_size and r.system == system]
    steps = sum(r.steps for r in mine)
    decode = sum(r.wall_s - r.prefill_s for r in mine)
    return decode / steps, sum(r.prefill_s for r in mine) / len(mine), sum(r.live_rows * r.steps for r in mine) / steps


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="timed (ours, hf) pairs per batch size")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 or auto")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for both systems (default: torch's choice)")
    parser.add_argument("--gsm8k", type=Path, default=DEFAULT_GSM8K, help="GSM8K test jsonl (synthetic if absent)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--profile", action="store_true", help="also profile one batch-1 rollout of ours")
    parser.add_argument("--compile", action="store_true", help="also run our engine with the compiled decode step")
    parser.add_argument("--sync-every", type=int, default=8, help="our engine's steps between host reads")
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=tuple(DTYPES),
                        help="weights and activations of every system; two dtypes run side by side, alternating")
    args = parser.parse_args(argv)
    for name in ("max_new_tokens", "repeats", "sync_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.batch_sizes) < 1:
        parser.error("--batch-sizes must all be >= 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    if len(set(args.dtype)) < len(args.dtype):
        parser.error("--dtype lists a dtype twice")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    systems = ["ours", "compiled", "hf"] if args.compile else ["ours", "hf"]
    # Per dtype: our model, transformers' model and our engines (eager, compiled).
    models, hf_models, engines = {}, {}, {}
    for dtype in args.dtype:
        model, tokenizer = load_causal_lm(MODEL, dtype=dtype, device=device)
        models[dtype] = model
        hf_models[dtype] = AutoModelForCausalLM.from_pretrained(
            resolve_checkpoint(MODEL), dtype=DTYPES[dtype]).to(device).eval()
        engines[dtype, "ours"] = RolloutEngine(model, tokenizer, sync_every=args.sync_every)
        if args.compile:
            engines[dtype, "compiled"] = RolloutEngine(model, tokenizer, compile=True, sync_every=args.sync_every)
    eos_ids = list(model.config.eos_token_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    prompts, source = load_prompts(tokenizer, max(args.batch_sizes), args.gsm8k)

    def one(dtype: str, system: str, batch: list[list[int]], max_new_tokens: int, seed: int):
        if (dtype, system) in engines:
            return run_ours(engines[dtype, system], batch, max_new_tokens, seed, device)
        return run_hf(hf_models[dtype], batch, max_new_tokens, seed, device, eos_ids, pad_id)

    runs: list[TimedBatch] = []
    compile_s = 0.0
    # Dtypes alternate inside each repeat like the systems, so machine load hits them alike.
    schedule = [(b, r, d, s) for b in args.batch_sizes for r in range(-1, args.repeats) for d in args.dtype
                for s in systems]
    with tqdm(schedule, desc="engine vs hf", unit="run") as bar:
        for b, repeat, dtype, system in bar:
            warmup = repeat < 0
            bar.set_postfix_str(f"batch {b} {dtype} {system}{' warm-up' if warmup else f' #{repeat + 1}'}")
            # A compiled warm-up decodes as far as a timed run, so every shape compiles there.
            length = WARMUP_TOKENS if warmup and system != "compiled" else args.max_new_tokens
            tokens, wall, steps, stats = one(dtype, system, prompts[:b], length, max(repeat, 0))
            compile_s += stats.compile_s if stats is not None else 0.0
            if not warmup and stats is None:  # transformers' generate
                runs.append(TimedBatch(system, b, repeat, tokens, wall, steps, dtype=dtype))
            elif not warmup:
                live = stats.active_rows_per_step
                runs.append(TimedBatch(system, b, repeat, tokens, wall, stats.steps, stats.prefill_s,
                                sum(live) / max(len(live), 1), dtype))
                if args.json:  # a long run that gets interrupted still leaves its measurements
                    args.json.write_text(json.dumps({"complete": False, "runs": [run_record(r) for r in runs]}, indent=2))
                bar.write(f"  batch {b:>3} {dtype} {system:>4} #{repeat + 1}: {tokens} tokens in {wall:.2f} s "
                          f"= {tokens / wall:.1f} tok/s")

    result = {
        "model": MODEL, "device": str(device), "dtypes": args.dtype, "threads": torch.get_num_threads(),
        "prompts": source, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
        "sync_every": args.sync_every, "compile_s": compile_s, "runs": [run_record(r) for r in runs], "complete": True,
        "by_dtype": {d: report(d, models[d], [r for r in runs if r.dtype == d], systems, args, prompts, source, device)
                     for d in args.dtype},
    }
    if args.compile:
        print(f"compilation: {compile_s:.1f} s in the warm-up calls (cached on disk for later runs)")
    if len(args.dtype) > 1:
        result["dtype_speedups"] = dtype_speedups(runs, args.dtype, systems, args.batch_sizes)
    if args.profile:
        print("\nours, batch 1, top ops by self CPU time:")
        print(profile_batch_one(engines[args.dtype[0], "ours"], prompts[0], min(args.max_new_tokens, 32)))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return result


def report(dtype: str, model, runs: list[TimedBatch], systems: list[str], args, prompts, source: str, device) -> dict:
    """Print and return one dtype's results: tokens/s per system, and decode steps against the floors."""
    table = summarise(runs, args.batch_sizes, systems)
    print(f"\nSmolLM2-135M-Instruct {dtype} on {device} ({torch.get_num_threads()} threads), prompts: {source}, "
          f"max_new_tokens {args.max_new_tokens}, {args.repeats} timed runs each, sync every {args.sync_every} steps")
    print(f"{'batch':>5}  " + "  ".join(f"{s + ' tok/s':>14}" for s in systems) + f"  {'ours/hf':>7}"
          + (f"  {'compiled/hf':>11}" if args.compile else ""))
    for row in table:
        print(f"{row['batch_size']:>5}  " + "  ".join(f"{row[s + '_tok_s']:>14.1f}" for s in systems)
              + f"  {row['ratio']:>7.2f}" + (f"  {row['compiled_ratio']:>11.2f}" if args.compile else ""))
    result = {"results": table}
    ours = [s for s in systems if s != "hf"]
    if 1 in args.batch_sizes:
        bandwidth = memory_bandwidth_gbs(device)
        weight_bytes = weight_bytes_per_step(model)
        floor_s = weight_bytes / (bandwidth * 1e9)
        hf_s = step_seconds(runs, "hf")
        print(f"\nbatch-1 weight-read floor: {weight_bytes / 1e6:.0f} MB of parameters per step (tied embedding "
              f"counted once, read by the LM head) at {bandwidth:.1f} GB/s copy bandwidth = {floor_s * 1e3:.1f} ms")
        result["batch1_floor"] = {"weight_bytes": weight_bytes, "bandwidth_gbs": bandwidth, "floor_ms": floor_s * 1e3,
                                  "hf_ms_per_token": hf_s * 1e3}
        for system in ours:
            step_s, prefill_s, _ = decode_step_seconds(runs, 1, system)
            print(f"batch-1 decode step, {system}: {step_s * 1e3:.1f} ms = {step_s / floor_s:.2f}x the floor "
                  f"(prefill {prefill_s * 1e3:.0f} ms per call, apart); wall per token {step_seconds(runs, system) * 1e3:.1f} ms")
            result["batch1_floor"][system] = {"decode_step_ms": step_s * 1e3, "times_floor": step_s / floor_s,
                                              "prefill_ms": prefill_s * 1e3, "ms_per_token": step_seconds(runs, system) * 1e3}
        print(f"batch-1 wall per token, hf: {hf_s * 1e3:.1f} ms = {hf_s / floor_s:.2f}x the floor (prefill included)")
    largest = max(args.batch_sizes)
    if largest > 1:
        gflops = matmul_gflops(device, DTYPES[dtype])
        result["matmul_floor"] = {"batch_size": largest, "matmul_gflops": gflops}
        context = sum(len(p) for p in prompts[:largest]) / largest + args.max_new_tokens / 2
        for system in ours:
            step_s, prefill_s, live = decode_step_seconds(runs, largest, system)
            floor_s = decode_step_flops(model, live, context) / (gflops * 1e9)
            print(f"batch-{largest} decode step, {system}: {step_s * 1e3:.1f} ms for {live:.1f} live rows = "
                  f"{step_s / floor_s:.2f}x the {dtype} matmul floor ({floor_s * 1e3:.1f} ms at {gflops:.0f} GFLOP/s); "
                  f"prefill {prefill_s:.2f} s per call, apart")
            result["matmul_floor"][system] = {"decode_step_ms": step_s * 1e3, "floor_ms": floor_s * 1e3,
                                              "times_floor": step_s / floor_s, "live_rows": live, "prefill_s": prefill_s}
    return result


def call_speeds(runs: list[TimedBatch], batch_size: int, system: str, dtype: str) -> tuple[float, float | None, float | None]:
    """(tokens/s of whole calls, seconds per decode step, prefill seconds per call) of one system
    in one dtype; the last two for our engine only (None for transformers)."""
    mine = [r for r in runs if r.batch_size == batch_size and r.system == system and r.dtype == dtype]
    tokens_per_s = sum(r.tokens for r in mine) / sum(r.wall_s for r in mine)
    if system == "hf":
        return tokens_per_s, None, None
    step_s, prefill_s, _ = decode_step_seconds(mine, batch_size, system)
    return tokens_per_s, step_s, prefill_s


def dtype_speedups(runs: list[TimedBatch], dtypes: list[str], systems: list[str], batch_sizes: list[int]) -> list[dict]:
    """Print and return, per batch size and system, each later dtype's speed over the first one
    (tokens/s of whole calls; for our engine also decode steps alone and prefill), measured side by side."""
    base, rows = dtypes[0], []
    print()
    for b in batch_sizes:
        for system in systems:
            before = call_speeds(runs, b, system, base)
            for dtype in dtypes[1:]:
                after = call_speeds(runs, b, system, dtype)
                row = {"batch_size": b, "system": system, "dtype": dtype, "over": base,
                       "tokens_per_s_ratio": after[0] / before[0]}
                line = f"{dtype} over {base}, batch {b} {system}: tokens/s {row['tokens_per_s_ratio']:.2f}x"
                if system != "hf":
                    row |= {"decode_step_speedup": before[1] / after[1], "prefill_speedup": before[2] / after[2]}
                    line += f", decode step {row['decode_step_speedup']:.2f}x, prefill {row['prefill_speedup']:.2f}x"
                rows.append(row)
                print(line)
    return rows


if __name__ == "__main__":
    main()
