"""Plain vs speculative generation, side by side in one run (docs/algorithm.md, section 9).

Same policy, prompts, seeds and sampling settings (temperature 1, top_p 1, max 256 new
tokens by default; `--temperature`, `--top-p`) at several concurrencies (c prompts x 1
response) and on a GRPO-shaped batch (8 prompts x 8 responses). Each setting alternates plain
and speculative runs (which one goes first alternates too); the ratio's standard error is the
spread of the repeats' ratios.
Both engines sample the same responses for the same seed (speculation/verification/verify.py): the share that came
out identical, token for token, is printed (`same`).

Where the budget decodes plain, the speculative engine scores would-be trees (`would-be`: the
tokens per verify pass its drafts would have carried, speculation/verification/would_be.py);
`--would-be-off-engine` also times it with would-be trees off (`wb/off`: the ratio of the two).

For every speculative run we also report the oracle bound (benchmarks/oracle.py): the tokens
per verify step that a drafter knowing the policy's exact next-token distributions along the
sampled responses would get with the same per-step node budgets.

    python -m specroll.benchmarks.spec_vs_plain [--policy smollm2-135m-instruct] [--heads shipped]
        [--concurrency 1 8 32] [--grpo 8x8] [--max-new-tokens 256] [--json out.json]
        [--would-be-every 32] [--would-be-off-engine]
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specroll.speculation import SpeculationConfig, SpeculativeDecoder

from ..models import load_causal_lm, synchronize
from ..rollout import RolloutEngine, SamplingParams
from .engine_vs_hf import DEFAULT_GSM8K, load_prompts
from .oracle import oracle_tokens_per_step


def repeat_ratio_se(pairs: list[tuple[float, float]]) -> float | None:
    """Standard error of the speculative / plain speed ratio over repeats: the spread of each
    repeat's ratio (pairs of (plain, spec) tokens/s) over sqrt(repeats); None for one repeat."""
    if len(pairs) < 2:
        return None
    ratios = [spec / plain for plain, spec in pairs]
    mean = sum(ratios) / len(ratios)
    return math.sqrt(sum((x - mean) ** 2 for x in ratios) / (len(ratios) - 1) / len(ratios))


def plain_row_off(row: dict, tolerance: float = 0.03) -> bool:
    """Whether a row whose speculative engine decoded plain throughout (every budget of every
    repeat 1) reads off 1.00x by more than `tolerance` and three standard errors: it measured
    something else."""
    if row["max_budget"] != 1:
        return False
    return abs(row["speedup"] - 1.0) > max(tolerance, 3 * (row["speedup_se"] or 0.0))


def timed_generate(engine, prompts, params, device):
    synchronize(device)
    started = time.perf_counter()
    out = engine.generate(prompts, params)
    synchronize(device)
    return out, time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="smollm2-135m-instruct", help="alias, HF directory (e.g. an SFT output)")
    ap.add_argument("--heads", default="shipped", help="'shipped' (SpecRoll's heads for the policy), a file, or 'untrained'")
    ap.add_argument("--head-type", default="path", help="for untrained heads")
    ap.add_argument("--budget", default="concurrency", choices=["fixed", "concurrency", "cost_model"])
    ap.add_argument("--fixed-nodes", type=int, default=8)
    ap.add_argument("--max-nodes", type=int, default=16)
    ap.add_argument("--capacity", type=int, default=None, help="C_hw override (default: hardware profile)")
    ap.add_argument("--sync-free-trees", choices=["auto", "on", "off"], default="auto",
                    help="tree steps without host reads (speculation.sync_free_trees; auto: on GPUs only)")
    ap.add_argument("--no-context-lookup", action="store_true", help="draft with the heads only (see speculation/drafting/lookup.py)")
    ap.add_argument("--would-be-every", type=int, default=SpeculationConfig.would_be_every,
                    help="speculation.would_be_every: a would-be tree every this many plain steps (0: off)")
    ap.add_argument("--would-be-off-engine", action="store_true",
                    help="also time the speculative engine with would-be trees off (wb/off column)")
    ap.add_argument("--no-head-drafts", action="store_true", help="draft the lookups' chains only (the root still verifies)")
    ap.add_argument("--sibling-lookup", action="store_true", help="also draft from the group siblings' text so far")
    ap.add_argument("--history-lookup", action="store_true",
                    help="also draft from earlier responses to the prompt: each repeat's responses are kept for the next")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--grpo", default="8x8", help="prompts x responses, or '' to skip")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus mass kept, in (0, 1]")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--compile", action="store_true", help="also run both engines with the compiled decode step")
    ap.add_argument("--no-eager", action="store_true", help="with --compile: the compiled engines only")
    ap.add_argument("--combo-kernels", action="store_true",
                    help="with --compile: inductor launches independent kernels as one (combo kernels, GPUs only)")
    args = ap.parse_args(argv)
    if args.no_eager and not args.compile:
        ap.error("--no-eager needs --compile: there would be nothing to time")
    if args.combo_kernels and not args.compile:
        ap.error("--combo-kernels needs --compile")
    with torch._inductor.config.patch(combo_kernels=args.combo_kernels):  # for every graph the run compiles
        return run(args)


def run(args: argparse.Namespace) -> dict:
    model, tokenizer = load_causal_lm(args.policy, dtype=args.dtype, device=args.device)
    device = next(model.parameters()).device
    heads_path = None if args.heads == "untrained" else args.heads
    spec = SpeculationConfig(head_type=args.head_type, heads_path=heads_path, budget=args.budget,
                      fixed_nodes=min(args.fixed_nodes, args.max_nodes), max_nodes=args.max_nodes,
                      capacity=args.capacity, context_lookup=not args.no_context_lookup,
                      head_drafts=not args.no_head_drafts, sibling_lookup=args.sibling_lookup,
                      history_lookup=args.history_lookup,
                      sync_free_trees={"auto": None, "on": True, "off": False}[args.sync_free_trees],
                      would_be_every=args.would_be_every)
    modes = [("eager", False)] * (not args.no_eager) + [("compiled", True)] * args.compile
    settings = [(f"concurrency {c}", c, 1) for c in args.concurrency]
    if args.grpo:
        p, n = (int(x) for x in args.grpo.lower().split("x"))
        settings.append((f"grpo {p}x{n}", p, n))
    prompts_all, source = load_prompts(tokenizer, max(s[1] for s in settings), DEFAULT_GSM8K)
    warm = SamplingParams(max_new_tokens=4, seed=args.seed)

    rows, capacity, warm_up_s = [], {}, {}
    runs_per_repeat = 3 if args.would_be_off_engine else 2
    bar = tqdm(total=len(settings) * args.repeats * runs_per_repeat * len(modes), desc="benchmark", unit="run")
    # Mode by mode, each mode's engines built just before its runs: the eager rows come out
    # before the compiled engines spend minutes compiling.
    for (mode, on), (name, num_prompts, n) in ((m, s) for m in modes for s in settings):
        if mode not in capacity:
            started = time.perf_counter()
            plain_engine = RolloutEngine(model, tokenizer, compile=on)
            plain_engine.generate(prompts_all[:1], warm)
            plain_ready = time.perf_counter()
            # The decoder compiles its steps and profiles them as it is built.
            spec_engine = RolloutEngine(model, tokenizer, SpeculativeDecoder(model, spec, compile=on))
            spec_engine.generate(prompts_all[:1], warm)
            engines = [plain_engine, spec_engine]
            if args.would_be_off_engine:
                off = replace(spec, would_be_every=0)
                engines.append(RolloutEngine(model, tokenizer, SpeculativeDecoder(model, off, compile=on)))
                engines[-1].generate(prompts_all[:1], warm)
            warm_up_s[mode] = {"plain": plain_ready - started, "spec": time.perf_counter() - plain_ready}
            bar.write(f"{mode} engines ready: plain {warm_up_s[mode]['plain']:.0f} s, "
                      f"speculative {warm_up_s[mode]['spec']:.0f} s (built, compiled, profiled, warmed up)")
            capacity[mode], max_depth = spec_engine.decoder.capacity, spec_engine.decoder.depth
        prompts = prompts_all[:num_prompts]
        plain_t, spec_t, plain_tok, spec_tok = 0.0, 0.0, 0, 0
        plain_prefill, spec_prefill = 0.0, 0.0  # kept apart for the ratio of decoding alone
        per_step, oracle, budgets, draft_t, would_be_t, lookup_share = [], [], [], 0.0, 0.0, []
        max_budget = 0  # the largest node budget of any repeat's step (1: plain throughout)
        timed = []  # every timed call's stats
        pairs = []  # (plain, spec) tokens/s of each repeat
        would_be, off_pairs = [], []  # would-be tokens per pass; (would-be off, spec) tokens/s of each repeat
        same, responses = 0, 0  # speculative responses identical to the plain ones
        for r in range(args.repeats):
            params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=0,
                                    max_new_tokens=args.max_new_tokens, n=n, seed=args.seed + r)
            if mode == "compiled" and r == 0:  # compile the shapes of this setting before timing
                for engine in engines:
                    engine.generate(prompts, params)
            # Each repeat another engine goes first, so that a drift in machine speed cancels.
            order = engines[r % len(engines):] + engines[:r % len(engines)]
            calls = {engine: timed_generate(engine, prompts, params, device) for engine in order}
            bar.update(runs_per_repeat)
            if args.would_be_off_engine:
                off_out, off_wall = calls[engines[-1]]
                off_pairs.append((off_out.stats.tokens / off_wall, calls[spec_engine][0].stats.tokens / calls[spec_engine][1]))
            (plain_out, plain_wall), (out, wall) = calls[plain_engine], calls[spec_engine]
            spec_engine.decoder.learn_from_responses(prompts, out.token_ids, n)  # history lookup's, for the next repeat
            pairs.append((plain_out.stats.tokens / plain_wall, out.stats.tokens / wall))
            same += sum(a == b for a, b in zip(plain_out.token_ids, out.token_ids))
            responses += len(out.token_ids)
            plain_t, plain_tok = plain_t + plain_wall, plain_tok + plain_out.stats.tokens
            plain_prefill += plain_out.stats.prefill_s
            timed.append(plain_out.stats)
            spec_t, spec_tok = spec_t + wall, spec_tok + out.stats.tokens
            spec_prefill += out.stats.prefill_s
            timed.append(out.stats)
            draft_t += out.stats.tree.time_draft_s
            would_be_t += out.stats.tree.time_would_be_s
            per_step.append(out.stats.tree.tokens_per_step_mean)
            if out.stats.tree.would_be_passes:
                would_be.append(out.stats.tree.would_be_tokens_per_step)
            lookup_share.append(out.stats.tree.lookup_token_share)
            budgets = out.stats.tree.budget_per_step
            max_budget = max([max_budget, *budgets])
            oracle.append(oracle_tokens_per_step(model, prompts, out, params, budgets, max_depth))
        row = {
            "setting": name,
            "step": mode,
            "capacity": capacity[mode],
            "plain_tokens_per_s": plain_tok / plain_t,
            "spec_tokens_per_s": spec_tok / spec_t,
            "speedup": (spec_tok / spec_t) / (plain_tok / plain_t),
            "speedup_se": repeat_ratio_se(pairs),
            "decode_speedup": (spec_tok / (spec_t - spec_prefill)) / (plain_tok / (plain_t - plain_prefill)),
            "same_responses": same / responses,
            "tokens_per_step": sum(per_step) / len(per_step),
            "tokens_per_step_by_repeat": per_step,
            "oracle_tokens_per_step": sum(oracle) / len(oracle),
            "would_be_tokens_per_step": sum(would_be) / len(would_be) if would_be else None,
            # The speculative engine with would-be trees against itself without them.
            "would_be_vs_off": (sum(s for _, s in off_pairs) / sum(o for o, _ in off_pairs)) if off_pairs else None,
            "draft_share": draft_t / spec_t,  # of the speculative wall time
            "would_be_draft_share": would_be_t / spec_t,  # the same, drafting would-be trees
            "lookup_token_share": sum(lookup_share) / len(lookup_share),  # accepted drafts proposed by context lookup
            "budget_trace": budgets,
            "max_budget": max_budget,
            "acceptance_by_depth": out.stats.tree.acceptance_by_depth,
            # Graphs compiled inside timed calls: shapes the warm-up missed.
            "compiles_while_timed": sum(stats.compiles for stats in timed),
            "compile_s_while_timed": sum(stats.compile_s for stats in timed),
        }
        rows.append(row)
        bar.write(f"{name} ({mode}): {row['speedup']:.2f}x, {row['tokens_per_step']:.2f} tokens/step")
    bar.close()

    budget = f"fixed {spec.fixed_nodes} nodes" if args.budget == "fixed" else args.budget
    if args.budget == "concurrency":
        budget += " (C_hw " + ", ".join(f"{c} {mode}" for mode, c in capacity.items()) + ")"
    print(f"\npolicy {args.policy}, heads {heads_path or 'untrained ' + args.head_type}, budget {budget}, "
          f"context lookup {'off' if args.no_context_lookup else 'on'}, "
          f"sibling lookup {'on' if args.sibling_lookup else 'off'}, history lookup {'on' if args.history_lookup else 'off'}, "
          f"head drafts {'off' if args.no_head_drafts else 'on'}, prompts from {source}, device {device}, {args.dtype}, "
          f"temperature {args.temperature}, top_p {args.top_p}, sync-free trees {args.sync_free_trees}")
    print(f"{'setting':>16} {'step':>8} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} {'± s.e.':>6} {'decode':>6} "
          f"{'tok/step':>8} {'would-be':>8} {'wb/off':>6} {'oracle':>7} {'drafting':>8} {'lookup':>6} {'same':>5}  budget trace")
    for row in rows:
        trace = row["budget_trace"]
        summary = f"{min(trace)}..{max(trace)} (mean {sum(trace) / len(trace):.1f})" if trace else "-"
        se = "-" if row["speedup_se"] is None else f"{row['speedup_se']:.3f}"
        would_be = "-" if row["would_be_tokens_per_step"] is None else f"{row['would_be_tokens_per_step']:.2f}"
        vs_off = "-" if row["would_be_vs_off"] is None else f"{row['would_be_vs_off']:.3f}"
        print(f"{row['setting']:>16} {row['step']:>8} {row['plain_tokens_per_s']:11.1f} {row['spec_tokens_per_s']:10.1f} "
              f"{row['speedup']:6.2f} {se:>6} {row['decode_speedup']:6.2f} {row['tokens_per_step']:8.2f} {would_be:>8} {vs_off:>6} "
              f"{row['oracle_tokens_per_step']:7.2f} {row['draft_share']:8.1%} {row['lookup_token_share']:6.0%} "
              f"{row['same_responses']:5.0%}  "
              f"{summary}")
    for row in rows:
        if plain_row_off(row):
            print(f"warning: {row['setting']} ({row['step']}) decoded plain throughout yet reads {row['speedup']:.2f}x: "
                  "the engines' plain steps cost differently here (on Python 3.11-3.12 possibly the call depth "
                  "they run at, see docs/guide.md#compiled-decoding)")
        if row["compiles_while_timed"]:
            print(f"warning: {row['setting']} ({row['step']}) compiled {row['compiles_while_timed']} graph(s) "
                  f"inside timed runs ({row['compile_s_while_timed']:.0f} s): its ratio counts them")
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "capacity": capacity[modes[0][0]],
              "warm_up_s": warm_up_s, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
