"""Learner tokens/s against the machine's matmul floor, and where the rest of a step goes.

Runs `GRPOLearner.update` (real DeepSpeed engine: forward, backward, optimizer step, with the
micro-batches the config sets) on random responses and compares its speed with the floor that
the machine's measured square fp32 matmul throughput allows for a model of this size:

    floor seconds = 6 x parameters x tokens / GEMM FLOP/s

(2 FLOPs per parameter and token forward, 4 backward). GEMM bursts are interleaved with the
update steps, so a shared machine's load weighs on both alike; the fraction reported is the
median over steps of floor seconds / step seconds, in wall-clock time and in the process's CPU
time (which a loaded machine's waits do not inflate). A last, profiled step (torch.profiler) splits
the step by phase (the `specroll.learner.phases` ranges) and by kind of operation: matmuls of
the transformer body, matmuls of the LM head (operations on a vocabulary-wide dimension),
vocabulary-wide non-matmul work (log-softmax, entropy and their backward), attention, other
operations, and what runs outside any operation (Python, DeepSpeed bookkeeping), and lists the
operations that take the most time. Last, one `compute_logprobs` pass is timed: what a separate
old-log-prob pass costs where several epochs or mini-batches need one.

    python -m specroll.benchmarks.learner_floor [--model tiny] [--json out.json] [hydra overrides ...]

The learner settings are the `--preset` experiment's (the quickstart's by default), and so are
the threads (those the learner actor trains with, `specroll.actors.threads`; `--threads` overrides)
and the batch (a step's responses, at most `rollout.max_new_tokens` long); extra arguments are
Hydra overrides, e.g. `learner.micro_batch_tokens=4096`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ..actors.threads import node_cores, phase_threads
from ..command_line import compose_train_config
from ..learner import GRPOLearner, GRPOSamples
from ..learner.phases import PHASES, PREFIX

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_mkldnn_linear"}
ATTENTION_MARK = "scaled_dot_product"
TOP_OPS = 12  # operations listed by their own time


def parameter_count(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied embedding and LM head count once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def clocks() -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process over all its threads)."""
    return time.perf_counter(), time.process_time()


def gemm_flops(size: int, min_seconds: float) -> tuple[float, float]:
    """FLOPs per wall second and per CPU second of a square fp32 matmul `size` x `size` @ `size` x
    `size`, repeated for `min_seconds`."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    out = torch.empty(size, size)
    torch.mm(a, b, out=out)  # first call: thread pool and kernel selection
    runs, (wall, cpu) = 0, clocks()
    while (elapsed := time.perf_counter() - wall) < min_seconds or runs < 2:
        torch.mm(a, b, out=out)
        runs += 1
    flops = 2 * size**3 * runs
    return flops / elapsed, flops / max(time.process_time() - cpu, 1e-9)


def random_samples(vocab_size: int, sequences: int, prompt_len: int, response_len: int, seed: int) -> GRPOSamples:
    """Random tokens; prompt lengths in [7/8, 1] x prompt_len and responses in [3/4, 1] x
    response_len (rollouts vary in length, so micro-batches carry some padding)."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(longest: int, shortest: int) -> list[int]:
        length = int(torch.randint(max(1, shortest), longest + 1, (1,), generator=gen))
        return torch.randint(2, vocab_size, (length,), generator=gen).tolist()

    prompts = [tokens(prompt_len, prompt_len * 7 // 8) for _ in range(sequences)]
    responses = [tokens(response_len, response_len * 3 // 4) for _ in range(sequences)]
    return GRPOSamples(prompts, responses, torch.randn(sequences, generator=gen))


def op_category(name: str, shapes: list, vocab_size: int) -> str:
    vocab_wide = any(vocab_size in shape for shape in shapes if isinstance(shape, (list, tuple)))
    if name in GEMM_OPS:
        return "gemm_lm_head" if vocab_wide else "gemm_body"
    if ATTENTION_MARK in name:
        return "attention"
    return "vocab_elementwise" if vocab_wide else "other_ops"


def profiled_breakdown(learner: GRPOLearner, samples: GRPOSamples, vocab_size: int) -> dict:
    """Seconds of one profiled update: in total, per phase, and per kind of operation."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        started = time.perf_counter()
        learner.update(samples)
        total = time.perf_counter() - started
    phases = dict.fromkeys(PHASES, 0.0)
    ops = dict.fromkeys(("gemm_body", "gemm_lm_head", "attention", "vocab_elementwise", "other_ops"), 0.0)
    by_name: dict[str, float] = {}
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key.startswith(PREFIX):
            phases[event.key[len(PREFIX):]] += event.cpu_time_total / 1e6
        else:
            ops[op_category(event.key, event.input_shapes, vocab_size)] += event.self_cpu_time_total / 1e6
            by_name[event.key] = by_name.get(event.key, 0.0) + event.self_cpu_time_total / 1e6
    # Ranges nest only in time: "logprobs" holds no forward, "backward" holds the whole backward.
    phases["outside_phases"] = max(0.0, total - sum(phases.values()))
    ops["outside_ops"] = max(0.0, total - sum(ops.values()))
    top = dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP_OPS])
    return {"seconds": total, "phases": phases, "ops": ops, "top_ops": top}


def load_setup(args, overrides: list[str]):
    """(model, learner config, the learner actor's CPU threads) as the preset and overrides configure
    them, on the CPU in float32; `--sequences` and `--response-len` default to one step's rollouts."""
    # The tiny model takes SmolLM2's vocabulary: its own (64) equals other widths, and the
    # operations on the vocabulary are told apart by their size.
    model = ["model.name=tiny-llama", "model.tokenizer=smollm2-135m-instruct"] if args.model == "tiny" else [
        f"model.name={args.model}"]
    settings = [f"experiment={args.preset}", *model, "model.device=cpu", "learner.device=cpu"]
    cfg = compose_train_config(settings + overrides)
    args.sequences = args.sequences or cfg.data.prompts_per_step * cfg.rollout.n
    args.response_len = args.response_len or cfg.rollout.max_new_tokens
    learner = replace(cfg.learner, max_response_len=max(cfg.learner.max_response_len, args.response_len),
                      max_seq_len=max(cfg.learner.max_seq_len, args.prompt_len + args.response_len + 1))
    model, _ = replace(cfg.model, dtype="float32").load(seed=cfg.seed)
    return model, learner, phase_threads(cfg.cluster, node_cores()).learner


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="policy as model.name takes it, or 'tiny' (2 random layers, SmolLM2's vocabulary)")
    ap.add_argument("--preset", default="quickstart", help="experiment preset whose learner settings are used")
    ap.add_argument("--sequences", type=int, default=None,
                    help="responses per update; default: a step's (data.prompts_per_step x rollout.n)")
    ap.add_argument("--prompt-len", type=int, default=128, help="longest prompt, tokens")
    ap.add_argument("--response-len", type=int, default=None,
                    help="longest response, tokens; default: rollout.max_new_tokens")
    ap.add_argument("--steps", type=int, default=3, help="timed update steps (after one warm-up step)")
    ap.add_argument("--gemm-sizes", type=int, nargs="+", default=[512, 1024, 2048],
                    help="square matmul sizes; the fastest sets the floor")
    ap.add_argument("--gemm-seconds", type=float, default=0.3, help="seconds per matmul size and burst")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads; default: the learner actor's while it trains")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args, overrides = ap.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        ap.error(f"unknown arguments {bad}; extra arguments must be Hydra overrides key=value")

    model, learner_cfg, actor_threads = load_setup(args, overrides)
    args.threads = args.threads or actor_threads
    torch.set_num_threads(args.threads)
    vocab_size, params = model.config.vocab_size, parameter_count(model)
    learner = GRPOLearner(model, learner_cfg)
    samples = random_samples(vocab_size, args.sequences, args.prompt_len, args.response_len, args.seed)
    tokens = sum(samples.sequence_lengths())
    floor_flops = 6 * params * tokens

    learner.update(samples)  # warm-up: allocator, thread pool, optimizer state
    steps = []
    for _ in range(args.steps):
        gemm = {size: gemm_flops(size, args.gemm_seconds) for size in args.gemm_sizes}
        wall, cpu = clocks()
        metrics = learner.update(samples)
        seconds, cpu_seconds = time.perf_counter() - wall, time.process_time() - cpu
        best, best_cpu = max(rate for rate, _ in gemm.values()), max(rate for _, rate in gemm.values())
        steps.append({"seconds": seconds, "cpu_seconds": cpu_seconds, "gemm_flops": gemm,
                      "floor_seconds": floor_flops / best, "fraction_of_floor": floor_flops / best / seconds,
                      "fraction_of_floor_cpu": floor_flops / best_cpu / cpu_seconds,
                      "padding_frac": metrics["train/padding_frac"]})
    breakdown = profiled_breakdown(learner, samples, vocab_size)
    # What a separate old-log-prob pass would add; with one epoch of one mini-batch the update skips it.
    started = time.perf_counter()
    learner.compute_logprobs(samples)
    old_logprob_pass = time.perf_counter() - started

    seconds = statistics.median(s["seconds"] for s in steps)
    best_gemm = statistics.median(max(rate for rate, _ in s["gemm_flops"].values()) for s in steps)
    summary = {
        "model": model.config.name, "parameters": params, "tokens_per_step": tokens,
        "response_tokens_per_step": sum(len(r) for r in samples.response_ids), "threads": args.threads,
        "micro_batch_tokens": learner_cfg.micro_batch_tokens, "step_seconds": seconds,
        "tokens_per_s": tokens / seconds, "gemm_flops": best_gemm,
        "floor_tokens_per_s": best_gemm / (6 * params),
        "fraction_of_floor": statistics.median(s["fraction_of_floor"] for s in steps),
        "fraction_of_floor_cpu": statistics.median(s["fraction_of_floor_cpu"] for s in steps),
        "padding_frac": steps[-1]["padding_frac"],
        "old_logprob_pass_seconds": old_logprob_pass,
        "old_logprobs_from_update": learner.old_logprobs_from_update(len(samples)),
    }
    report(summary, breakdown)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "overrides": overrides,
                                         "learner": learner_cfg.to_dict(), "steps": steps,
                                         "breakdown": breakdown, "summary": summary}, indent=1))
    return summary


def report(summary: dict, breakdown: dict) -> None:
    s = summary
    print(f"\n{s['model']}: {s['parameters'] / 1e6:.1f}M parameters, {s['tokens_per_step']} tokens per update "
          f"({s['response_tokens_per_step']} response), micro-batches of {s['micro_batch_tokens']} tokens, "
          f"{s['threads']} threads, padding {s['padding_frac']:.1%}")
    print(f"learner: {s['tokens_per_s']:.1f} tokens/s ({s['step_seconds']:.2f} s per update)")
    print(f"floor:   {s['floor_tokens_per_s']:.1f} tokens/s (6 x parameters x tokens at {s['gemm_flops'] / 1e9:.1f} "
          f"GFLOP/s, the best square fp32 matmul)")
    print(f"fraction of the floor: {s['fraction_of_floor']:.1%} in wall-clock time, "
          f"{s['fraction_of_floor_cpu']:.1%} in CPU time (steadier on a shared machine)")
    skipped = "skipped: the update's forward gives them" if s["old_logprobs_from_update"] else "run before each update"
    print(f"separate old-log-prob pass: {s['old_logprob_pass_seconds']:.2f} s ({skipped})")
    total = breakdown["seconds"]
    print(f"\nwhere a profiled update's {total:.2f} s go")
    for title, parts in (("by phase", breakdown["phases"]), ("by operation", breakdown["ops"]),
                         ("largest operations", breakdown["top_ops"])):
        print(f"  {title}: " + ", ".join(f"{name} {sec / total:.0%}" for name, sec in parts.items()))


if __name__ == "__main__":
    main()
