"""Plain decoding's tokens/s under each sampler (rollout/samplers.py), side by side in one run.

Same policy, prompts and seeds for both; at each concurrency (c prompts x 1 response) the samplers
alternate run by run, which one goes first alternating too, so a drift in machine speed cancels;
the ratio's standard error is the spread of the repeats' ratios (`spec_vs_plain.repeat_ratio_se`).
Issue 62's goal: `gumbel` within 3% of `inverse_cdf`.

    python -m specroll.benchmarks.sampler_cost [--policy smollm2-135m-instruct | --tiny]
        [--concurrency 1 32] [--max-new-tokens 128] [--repeats 3] [--compile] [--json out.json]
"""
from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from ..models import build_tiny_model, load_causal_lm, resolve_device
from ..rollout import SAMPLERS, RolloutEngine, SamplingParams
from .engine_vs_hf import DEFAULT_GSM8K, load_prompts
from .flags import add_machine_flags, write_json
from .spec_vs_plain import repeat_ratio_se, timed_generate

TINY_VOCAB = 4096  # wide enough that a top-k over the vocabulary costs what it costs a real policy


def sampler_rows(engine: RolloutEngine, prompt_sets: dict[int, list[list[int]]], params: SamplingParams,
                 repeats: int) -> list[dict]:
    """Per concurrency (the keys of `prompt_sets`), each sampler's tokens/s over `repeats` alternating
    runs, and gumbel's over inverse_cdf's with its standard error."""
    device = next(engine.model.parameters()).device
    rows = []
    for concurrency, prompts in prompt_sets.items():
        engine.generate(prompts[:1], replace(params, max_new_tokens=4))  # warm-up (compiles, first-call costs)
        speeds = {name: [] for name in SAMPLERS}
        for r in range(repeats):
            order = SAMPLERS if r % 2 == 0 else SAMPLERS[::-1]
            for name in order:
                out, wall = timed_generate(engine, prompts, replace(params, sampler=name, seed=params.seed + r), device)
                speeds[name].append(out.stats.tokens / wall)
        pairs = list(zip(speeds["inverse_cdf"], speeds["gumbel"]))
        mean = {name: sum(v) / len(v) for name, v in speeds.items()}
        rows.append({"concurrency": concurrency, "inverse_cdf_tokens_s": mean["inverse_cdf"],
                     "gumbel_tokens_s": mean["gumbel"], "ratio": sum(g / i for i, g in pairs) / len(pairs),
                     "ratio_se": repeat_ratio_se(pairs)})
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="smollm2-135m-instruct", help="alias or HF directory")
    ap.add_argument("--tiny", action="store_true", help="a tiny random policy instead (tests, quick checks)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="the compiled plain decode step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    add_machine_flags(ap)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny:
        model = build_tiny_model(vocab_size=TINY_VOCAB, init_std=0.1, seed=0).requires_grad_(False)
        model, tokenizer = model.to(resolve_device(args.device)), None
        g = torch.Generator().manual_seed(args.seed)
        prompts = [torch.randint(2, TINY_VOCAB, (8,), generator=g).tolist() for _ in range(max(args.concurrency))]
        source, policy = "random", "tiny random policy"
    else:
        model, tokenizer = load_causal_lm(args.policy, dtype=args.dtype, device=args.device)
        prompts, source = load_prompts(tokenizer, max(args.concurrency), DEFAULT_GSM8K)
        policy = args.policy
    engine = RolloutEngine(model, tokenizer, compile=args.compile)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                            seed=args.seed)
    rows = sampler_rows(engine, {c: prompts[:c] for c in args.concurrency}, params, args.repeats)
    print(f"{policy}, prompts from {source}, T={args.temperature} top-p {args.top_p}, "
          f"{'compiled' if args.compile else 'eager'} plain decoding, {args.repeats} repeats")
    print(f"{'concurrency':>11} {'inverse_cdf tok/s':>18} {'gumbel tok/s':>13} {'gumbel/inverse_cdf':>19}")
    for row in rows:
        se = f" +- {row['ratio_se']:.3f}" if row["ratio_se"] is not None else ""
        print(f"{row['concurrency']:>11} {row['inverse_cdf_tokens_s']:>18.1f} {row['gumbel_tokens_s']:>13.1f} "
              f"{row['ratio']:>12.3f}{se}")
    result = {"policy": policy, "prompts": source, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
