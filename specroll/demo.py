"""Rollout demo: GRPO-shaped generation on SmolLM2 with plain and speculative decoding.

Runs offline on the built-in synthetic problems: 4 prompts x 4 responses each, once with
plain decoding and once with SpecRoll, same seeds, and prints rewards and throughput.

    python -m specroll.demo [--model smollm2-135m-instruct] [--prompts 4] [--n 4]
"""
from __future__ import annotations

import argparse

from specroll.speculation import SpeculationConfig, SpeculativeDecoder

from .data import SyntheticConfig, format_prompt, generate_synthetic, math_reward
from .models import load_causal_lm
from .rollout import RolloutEngine, SamplingParams


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4, help="responses per prompt (GRPO group size)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    print(f"loading {args.model} ...", flush=True)
    model, tokenizer = load_causal_lm(args.model, dtype=args.dtype, device=args.device)
    problems = generate_synthetic(SyntheticConfig(num_problems=args.prompts, seed=args.seed))
    prompts = [format_prompt(tokenizer, p.question) for p in problems]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, n=args.n, seed=args.seed)

    engines = {
        "vanilla": RolloutEngine(model, tokenizer, show_progress=True),
        "specroll": RolloutEngine(model, tokenizer, SpeculativeDecoder(model, SpeculationConfig(heads_path="shipped")),
                                  show_progress=True),
    }
    results = {}
    for name, engine in engines.items():
        out = engine.generate(prompts, params)
        texts = tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)
        golds = [p.answer for p in problems for _ in range(args.n)]
        rewards = [math_reward(t, g) for t, g in zip(texts, golds)]
        results[name] = (out, texts, sum(rewards) / len(rewards))

    print(f"\nQ: {problems[0].question}\nA (specroll sample): {results['specroll'][1][0].strip()}\n")
    print(f"{'engine':>9} {'tokens':>7} {'tok/s':>7} {'tok/step':>8} {'reward':>7}")
    for name, (out, _, reward) in results.items():
        per_step = out.stats.tree.tokens_per_step_mean if out.stats.tree is not None else 1.0
        print(f"{name:>9} {out.stats.tokens:7d} {out.stats.tokens_per_s:7.1f} {per_step:8.2f} {reward:7.2f}")
    speedup = results["specroll"][0].stats.tokens_per_s / results["vanilla"][0].stats.tokens_per_s
    print(f"\nspeculative / vanilla tokens per second: {speedup:.2f}x (samples differ, distributions are identical)")


if __name__ == "__main__":
    main()
