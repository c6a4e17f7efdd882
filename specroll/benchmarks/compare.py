"""Every rollout mode raced on the same GRPO steps: vanilla, FastGRPO-style, SpecRoll with each adaptation.

For each race (a policy and a prompt set) the real driver (`specroll.train.run_training`: Ray
actors, DeepSpeed learner) runs a few GRPO steps once per mode, with the same prompts, seeds,
policy and sampling settings: `rollout=vanilla`, `rollout=fastgrpo` (its drafter learns online
inside every step), and `rollout=speculation` with each `rollout.speculation.adaptation`. Then, engine
only, generation speed at fixed concurrency. Out: a markdown table (generation and step time,
ratios to vanilla and to FastGRPO, tokens per verify pass, acceptance by depth, drafter updates,
rewards with tests that the modes' rewards are indistinguishable), the paper's GPU figures in
their own labelled table, the JSON of `benchmarks.comparison_record.Comparison` (--json), PNG plots.

    python -m specroll.benchmarks.compare --quick --json runs/compare/compare.json
    python -m specroll.benchmarks.compare --policies instruct sft --datasets gsm8k synthetic
    python -m specroll.benchmarks.compare --tiny --modes vanilla fastgrpo speculation-both   # plumbing only

Every mode samples the same responses for a seed (speculation/verification/verify.py), up to float rounding, which
may fork a response; from a fork on, the learners' updates and so the policies differ, and so may
the rewards by chance; the p-values say whether beyond it. Extra arguments are Hydra overrides
for every run, except `rollout.speculation.*` (speculation modes only) and `rollout.fastgrpo.*` (fastgrpo only).
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from specroll.speculation import HorizonHeads, SpeculationConfig, SpeculativeDecoder, shipped_heads
from specroll.speculation.config import ADAPTATION_MODES

from ..fastgrpo import FastGRPOConfig, FastGRPODecoder, FeatureDrafter, OnlineConfig, shipped_drafter
from ..models import load_causal_lm, resolve_device
from ..rollout import Decoder, RolloutEngine, SamplingParams
from ..telemetry import metric_names as m
from ..telemetry import plots
from .comparison_record import Comparison, ConcurrencyPoint, ModeRun, RolloutTrace
from .engine_vs_hf import load_prompts
from .flags import fill_sizes
from .grpo_steps import GSM8K_TRAIN, driver_settings, run_driver, two_proportion_p, welch_p

VANILLA, FASTGRPO = "vanilla", "fastgrpo"
MODES = (VANILLA, FASTGRPO, *(f"speculation-{a}" for a in ADAPTATION_MODES))
INSTRUCT = "smollm2-135m-instruct"
SFT_POLICY = Path("~/.cache/specroll/sft/gsm8k200")  # the SFT recipe of docs/guide.md (Heads and SFT) on 200 GSM8K problems
SIZES = {"full": dict(steps=4, warmup_steps=1, prompts=4, n=4, max_new_tokens=128, concurrency=[1, 4, 16]),
         "quick": dict(steps=2, warmup_steps=1, prompts=2, n=4, max_new_tokens=48, concurrency=[1, 8])}
# Engine-only speed: the heads alone and the headline mode (in the engine alone no head update happens).
ENGINE_MODES = (VANILLA, FASTGRPO, "speculation-static", "speculation-both")
PAPER = [  # the papers' own GPU measurements (SpecRoll, 2026-08; FastGRPO), never ours
    {"source": "SpecRoll paper (2026-08), GPUs, Qwen2.5-1.5B..14B and Llama-3.1-8B", "mode": "speculation-both",
     "figure": "generation vs vanilla", "value": "1.26x-2.15x"},
    {"source": "SpecRoll paper", "mode": "speculation-both", "figure": "end-to-end step vs vanilla", "value": "1.21x-2.04x"},
    {"source": "SpecRoll paper", "mode": "speculation-both", "figure": "end-to-end step vs FastGRPO",
     "value": "1.18x on average, ahead in 15 of 15 settings"},
    {"source": "FastGRPO (arXiv 2509.21792), its own GPU setup", "mode": "fastgrpo", "figure": "end-to-end step vs vanilla",
     "value": "2.35x-2.72x"},
    {"source": "FastGRPO", "mode": "fastgrpo", "figure": "accepted tokens per pass, online learning on / off",
     "value": "~3.7 / ~2.5"},
]


@dataclass(frozen=True)
class Race:
    """The conditions all modes share: policy, prompts, and the drafters trained for that policy."""

    label: str  # "instruct/gsm8k"
    policy: str
    dataset: str
    heads: str  # rollout.speculation.heads_path
    drafter: str  # rollout.fastgrpo.drafter_path


def races(args) -> list[Race]:
    out = []
    for policy in args.policies:
        if args.tiny:
            name, heads, drafter = "tiny-llama", "null", "null"
        elif policy == "instruct":
            name, heads, drafter = INSTRUCT, "shipped", "shipped"
        else:  # the SFT'd policy drafts with the instruct policy's drafters (same architecture) unless given its own
            path = Path(args.sft_policy).expanduser()
            if not path.is_dir():
                raise FileNotFoundError(f"--policies sft: no SFT'd policy at {path} (the SFT recipe in docs/guide.md, Heads and SFT, writes it)")
            name = str(path)
            heads = args.sft_heads or str(shipped_heads(INSTRUCT))
            drafter = args.sft_drafter or str(shipped_drafter(INSTRUCT))
        out += [Race(f"{'tiny' if args.tiny else policy}/{dataset}", name, dataset, heads, drafter)
                for dataset in args.datasets]
    return out


def mode_overrides(mode: str, race: Race, args, extra: list[str]) -> list[str]:
    """The Hydra overrides of one mode's run: the shared settings, its rollout group, its own extras."""
    shared = driver_settings(race.policy, race.dataset, args.data_path, args.prompts, args.n, args.max_new_tokens,
                             args.steps, args.seed, Path(args.run_root) / race.label / mode)
    if args.tiny:
        shared = ["experiment=smoke", "logger.console=false", *shared]  # smoke's tiny model, with its tokenizer
    if mode == VANILLA:
        own = ["rollout=vanilla"]
    elif mode == FASTGRPO:
        own = ["rollout=fastgrpo", f"rollout.fastgrpo.drafter_path={race.drafter}"]
        if args.tiny:
            own.append("rollout.fastgrpo.capacity=8")  # no hardware profile of a throwaway model
    else:
        own = ["rollout=speculation", f"rollout.speculation.adaptation={mode.removeprefix('speculation-')}",
               f"rollout.speculation.heads_path={race.heads}"]
        if not args.tiny:
            own.append(f"rollout.speculation.budget={args.spec_budget}")
    keep = [o for o in extra if not o.startswith(("rollout.speculation.", "rollout.fastgrpo."))
            or (o.startswith("rollout.speculation.") and mode.startswith("speculation-"))
            or (o.startswith("rollout.fastgrpo.") and mode == FASTGRPO)]
    return [*shared, *own, *keep]


def run_mode(mode: str, race: Race, args, extra: list[str]) -> ModeRun:
    """One mode's GRPO steps, and rollout actor 0's decode-step trace of the first step after warm-up."""
    traces: list[RolloutTrace] = []

    def on_step_end(step: int, metrics: dict, actors) -> None:
        if step == args.warmup_steps and mode != VANILLA:
            stats = actors.rollout_stats()[0]
            traces.append(RolloutTrace(list(stats.active_rows_per_step), list(stats.tree.budget_per_step)))

    print(f"\n== {race.label}: {mode}", flush=True)
    steps = run_driver(Path(args.run_root) / race.label / mode, mode_overrides(mode, race, args, extra), on_step_end)
    rows = [{"step": i, **{k: finite(v) for k, v in s.items()}} for i, s in enumerate(steps)]
    rollout = mode.split("-")[0]
    adaptation = mode.removeprefix("speculation-") if rollout == "speculation" else None
    return ModeRun(race.label, mode, rollout, rows, adaptation, traces[0] if traces else None,
                   summarize_mode(rows, args.warmup_steps))


def finite(value) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


# -- statistics -------------------------------------------------------------------------------

def total(rows: list[dict], name: str) -> float:
    return sum(r.get(name) or 0.0 for r in rows)


def mean_of(rows: list[dict], name: str) -> float | None:
    values = [r[name] for r in rows if r.get(name) is not None]
    return sum(values) / len(values) if values else None


def summarize_mode(rows: list[dict], warmup: int) -> dict:
    """The table's figures: times over the steps after warm-up, rewards over all steps."""
    timed = rows[warmup:]
    depths = sorted(int(k.rsplit("_", 1)[1]) for k in rows[-1] if k.startswith("speculation/acceptance_depth_"))
    tokens = sum((r[m.RESPONSE_LENGTH_MEAN] or 0) * (r[m.NUM_SEQUENCES] or 0) for r in timed)
    responses = sum(r[m.NUM_SEQUENCES] or 0 for r in rows)
    correct = sum((r[m.ACCURACY] or 0) * (r[m.NUM_SEQUENCES] or 0) for r in rows)
    heads_updates = max((r.get(m.HEADS_UPDATES) or 0 for r in rows), default=0)
    drafter_updates = max((r.get(m.DRAFTER_UPDATES) or 0 for r in rows), default=0)
    return {
        "gen_s": total(timed, m.TIME_GEN),
        "step_s": total(timed, m.STEP_TIME_S),
        "gen_tokens_per_s": tokens / max(total(timed, m.TIME_GEN), 1e-9),
        "tokens_per_pass": mean_of(timed, m.TOKENS_PER_STEP),
        "acceptance_by_depth": [mean_of(timed, m.acceptance_depth(d)) for d in depths],
        "node_budget_mean": mean_of(timed, m.NODE_BUDGET_MEAN),
        # FastGRPO's online updates run inside the step; SpecRoll's head updates overlap the learner.
        "drafter_updates": int(max(heads_updates, drafter_updates)),
        "drafter_update_s": total(rows, m.TIME_DRAFTER_UPDATE) + total(rows, m.HEADS_UPDATE_S),
        # What of it the steps waited for: all of FastGRPO's, SpecRoll's beyond the learner.
        "drafter_update_wait_s": total(rows, m.TIME_DRAFTER_UPDATE) + total(rows, m.HEADS_UPDATE_WAIT_S),
        "reward_mean": sum((r[m.REWARD_MEAN] or 0) * (r[m.NUM_SEQUENCES] or 0) for r in rows) / max(responses, 1),
        "accuracy": correct / max(responses, 1),
        "responses": int(responses),
        "correct": round(correct),
    }


def add_ratios(runs: list[ModeRun]) -> None:
    """Speedups against vanilla and against FastGRPO (their seconds / this mode's), and p-values of
    'same rewards as vanilla', into each mode's summary."""
    by_name = {run.name: run for run in runs}
    for run in runs:
        s = run.summary
        for ref in (VANILLA, FASTGRPO):
            if ref in by_name:
                r = by_name[ref].summary
                s[f"gen_speedup_vs_{ref}"] = r["gen_s"] / max(s["gen_s"], 1e-9)
                s[f"step_speedup_vs_{ref}"] = r["step_s"] / max(s["step_s"], 1e-9)
        if VANILLA in by_name:
            v = by_name[VANILLA]
            s["accuracy_p_vs_vanilla"] = two_proportion_p(v.summary["correct"], v.summary["responses"], s["correct"],
                                                          s["responses"])
            s["reward_p_vs_vanilla"] = welch_p([r[m.REWARD_MEAN] for r in v.steps], [r[m.REWARD_MEAN] for r in run.steps])


def homogeneity(runs: list[ModeRun]) -> dict[str, float]:
    """p-values of 'all modes reward alike': chi-square on correct / wrong counts, Kruskal-Wallis on
    per-step mean rewards (1.0 where there is no spread to test)."""
    from scipy.stats import chi2_contingency, kruskal

    counts = [[r.summary["correct"], r.summary["responses"] - r.summary["correct"]] for r in runs]
    columns = [sum(c) for c in zip(*counts)]
    accuracy_p = 1.0 if min(columns) == 0 else float(chi2_contingency(counts)[1])
    rewards = [[s[m.REWARD_MEAN] for s in r.steps] for r in runs]
    flat = [x for group in rewards for x in group]
    reward_p = 1.0 if max(flat) == min(flat) else float(kruskal(*rewards).pvalue)
    return {"accuracy_chi2_p": accuracy_p, "reward_kruskal_p": reward_p}


# -- engine-only speed at fixed concurrency ----------------------------------------------------------

def engine_decoder(mode: str, race: Race, model, args) -> Decoder | None:
    """`mode`'s decoder of `model` in the engine alone (None: vanilla)."""
    if mode == VANILLA:
        return None
    if mode == FASTGRPO:
        path = None if race.drafter == "null" else race.drafter
        cfg = FastGRPOConfig(drafter_path=path, capacity=8 if args.tiny else None, online=OnlineConfig(enabled=False))
        return FastGRPODecoder(model, cfg)
    heads = None if race.heads == "null" else race.heads
    cfg = SpeculationConfig(heads_path=heads, adaptation=mode.removeprefix("speculation-"),
                            budget="fixed" if args.tiny else args.spec_budget, fixed_nodes=4)
    return SpeculativeDecoder(model, cfg)


def concurrency_points(race: Race, args) -> list[ConcurrencyPoint]:
    """Per concurrency c (c prompts, one response each), each engine mode's tokens/s over vanilla's, side by side."""
    if args.tiny:
        from ..configs import ModelSection

        model, tokenizer = ModelSection(name="tiny-llama", tokenizer=INSTRUCT).load(seed=args.seed)
    else:
        model, tokenizer = load_causal_lm(race.policy, dtype="float32", device="auto")
    pool, _ = load_prompts(tokenizer, max(args.concurrency), Path(args.data_path)
                           if race.dataset == "gsm8k" else Path("/nonexistent"))
    engines = {mode: RolloutEngine(model, tokenizer, engine_decoder(mode, race, model, args))
               for mode in ENGINE_MODES if mode in args.modes}
    threads = torch.get_num_threads()
    torch.set_num_threads(args.engine_threads)  # as a rollout actor's engine runs (one thread per reserved CPU)
    try:
        return measure_concurrency(race, engines, pool, args)
    finally:
        torch.set_num_threads(threads)


def measure_concurrency(race: Race, engines: dict[str, RolloutEngine], pool: list[list[int]], args) -> list[ConcurrencyPoint]:
    points = []
    for c in args.concurrency:
        prompts = (pool * c)[:c]
        params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, n=1, seed=args.seed)
        speed, passes = {}, {}
        for mode, engine in engines.items():
            engine.generate(prompts[:1], SamplingParams(max_new_tokens=4, seed=args.seed))  # warm-up
            out = engine.generate(prompts, params)
            speed[mode] = out.stats.tokens_per_s
            passes[mode] = out.stats.tree.tokens_per_step_mean if out.stats.tree is not None else None
            print(f"  concurrency {c:>3} {mode:<18} {speed[mode]:7.1f} tokens/s", flush=True)
        for mode in (mode for mode in speed if mode != VANILLA):
            points.append(ConcurrencyPoint(race.label, mode, c, speed[mode] / speed[VANILLA], passes[mode]))
    return points


# -- output -------------------------------------------------------------------------------------

def fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def markdown_table(comparison: Comparison) -> str:
    lines = []
    for race in comparison.races():
        tests = comparison.settings["reward_tests"][race]
        lines += [f"**{race}** (ours, {comparison.settings['machine']}): times over steps after warm-up; "
                  f"same rewards across all modes? accuracy chi-square p = {tests['accuracy_chi2_p']:.2f}, "
                  f"per-step rewards Kruskal-Wallis p = {tests['reward_kruskal_p']:.2f}", "",
                  "| mode | gen s | step s | gen x vanilla | step x vanilla | gen x fastgrpo | step x fastgrpo | "
                  "tokens/pass | acceptance by depth | drafter updates, all steps (s; the steps waited s) | reward | accuracy | "
                  "p vs vanilla (acc / reward) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for run in comparison.modes_of(race):
            s = run.summary
            depths = " ".join(fmt(a) for a in s["acceptance_by_depth"]) or "-"
            lines.append(
                f"| {run.name} | {s['gen_s']:.1f} | {s['step_s']:.1f} | {fmt(s.get('gen_speedup_vs_vanilla'), suffix='x')} | "
                f"{fmt(s.get('step_speedup_vs_vanilla'), suffix='x')} | {fmt(s.get('gen_speedup_vs_fastgrpo'), suffix='x')} | "
                f"{fmt(s.get('step_speedup_vs_fastgrpo'), suffix='x')} | {fmt(s['tokens_per_pass'])} | {depths} | "
                f"{s['drafter_updates']} ({s['drafter_update_s']:.1f}; {fmt(s.get('drafter_update_wait_s'), '.1f')}) | "
                f"{s['reward_mean']:.3f} | "
                f"{s['correct']}/{s['responses']} | {fmt(s.get('accuracy_p_vs_vanilla'))} / {fmt(s.get('reward_p_vs_vanilla'))} |")
        points = [p for p in comparison.concurrency if p.race == race]
        if points:
            rows = sorted({p.concurrency for p in points})
            modes = list(dict.fromkeys(p.mode for p in points))
            lines += ["", f"Generation speedup over vanilla at fixed concurrency, engine only ({race}):", "",
                      "| mode | " + " | ".join(f"concurrency {c}" for c in rows) + " |", "|---|" + "---|" * len(rows)]
            for mode in modes:
                by_c = {p.concurrency: p for p in points if p.mode == mode}
                lines.append(f"| {mode} | " + " | ".join(fmt(by_c[c].speedup, suffix="x") if c in by_c else "-"
                                                        for c in rows) + " |")
        lines.append("")
    lines += ["The papers' GPU results (labelled as such; not measured here):", "",
              "| source | mode | figure | value |", "|---|---|---|---|"]
    lines += [f"| {p['source']} | {p['mode']} | {p['figure']} | {p['value']} |" for p in comparison.paper]
    return "\n".join(lines) + "\n"


def save_plots(comparison: Comparison, directory: Path) -> list[Path]:
    """Per race: tokens per verify pass over steps, node budget against active rows, speedup by concurrency."""
    paths = []
    for race in comparison.races():
        slug = race.replace("/", "_")
        paths.append(directory / f"compare_{slug}_tokens_per_pass.png")
        plots.plot_tokens_per_pass(comparison.series(race, m.TOKENS_PER_STEP), path=paths[-1], title=race)
        paths.append(directory / f"compare_{slug}_budget_vs_rows.png")
        plots.plot_budget_trace(comparison.traces(race), path=paths[-1], title=race)
        if comparison.speedups(race):
            paths.append(directory / f"compare_{slug}_speedup_by_concurrency.png")
            plots.plot_speedup_by_concurrency(comparison.speedups(race), path=paths[-1], title=race)
    return paths


def machine() -> str:
    device = resolve_device("auto")
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}"


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"a small run: {SIZES['quick']} (under 15 min on a 2-core CPU)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random policy with untrained drafters (plumbing only)")
    ap.add_argument("--policies", nargs="+", choices=("instruct", "sft"), default=None,
                    help="instruct: SmolLM2-135M-Instruct; sft: --sft-policy (default: instruct, plus sft where it exists)")
    ap.add_argument("--datasets", nargs="+", choices=("gsm8k", "synthetic"), default=None,
                    help="prompt sets (default: gsm8k with --quick, else gsm8k and synthetic)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--sft-policy", default=str(SFT_POLICY))
    ap.add_argument("--sft-heads", default=None, help="heads for the SFT'd policy (default: the instruct policy's)")
    ap.add_argument("--sft-drafter", default=None, help="FastGRPO drafter for the SFT'd policy (default: the instruct one's)")
    ap.add_argument("--data-path", default=str(GSM8K_TRAIN), help="GSM8K jsonl file or folder")
    ap.add_argument("--spec-budget", default="auto", choices=("auto", "concurrency", "cost_model", "fixed"),
                    help="rollout.speculation.budget of the speculation modes (auto: cost_model on CPUs, concurrency on GPUs)")
    for name, value in SIZES["full"].items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, nargs="*" if name == "concurrency" else None,
                        default=None, help=f"default {value} ({SIZES['quick'][name]} with --quick)")
    ap.add_argument("--engine-threads", type=int, default=1,
                    help="torch threads of the engine-only runs (a rollout actor takes one per reserved CPU; default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-root", default="runs/compare", help="each race and mode's run_dir goes under it")
    ap.add_argument("--json", type=Path, default=None, help="write the comparison (benchmarks.comparison_record schema) here")
    ap.add_argument("--plots", type=Path, default=None, help="folder for the PNGs (default: beside --json, else run-root)")
    args, extra = ap.parse_known_args(argv)
    fill_sizes(args, SIZES, args.quick or args.tiny)
    if args.tiny:
        args.policies, args.datasets = ["instruct"], args.datasets or ["synthetic"]
    if args.policies is None:
        sft = Path(args.sft_policy).expanduser().is_dir() and not args.quick
        args.policies = ["instruct", "sft"] if sft else ["instruct"]
    args.datasets = args.datasets or (["gsm8k"] if args.quick else ["gsm8k", "synthetic"])
    if not 0 <= args.warmup_steps < args.steps:
        ap.error(f"--warmup-steps ({args.warmup_steps}) must be in [0, --steps ({args.steps}))")
    if VANILLA not in args.modes:
        ap.error("--modes must include vanilla: every ratio is against it")
    bad = [o for o in extra if "=" not in o]
    if bad:
        ap.error(f"unknown arguments {bad}; extra arguments must be Hydra overrides key=value")
    return args, extra


def main(argv=None) -> Comparison:
    args, extra = parse_args(argv)
    modes = [mode for mode in MODES if mode in args.modes]
    runs, points, tests = [], [], {}
    for race in races(args):
        race_runs = [run_mode(mode, race, args, extra) for mode in modes]
        add_ratios(race_runs)
        tests[race.label] = homogeneity(race_runs)
        runs += race_runs
        if args.concurrency:
            points += concurrency_points(race, args)
    settings = {"command": " ".join(["python -m specroll.benchmarks.compare", *(sys.argv[1:] if argv is None else argv)]),
                "created": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
                "quick": args.quick, "tiny": args.tiny, "policies": args.policies, "datasets": args.datasets,
                "prompts": args.prompts, "n": args.n, "max_new_tokens": args.max_new_tokens, "steps": args.steps,
                "warmup_steps": args.warmup_steps, "seed": args.seed, "spec_budget": args.spec_budget,
                "overrides": extra, "reward_tests": tests}
    comparison = Comparison(runs, points, settings, PAPER)
    comparison = Comparison(runs, points, settings, PAPER, table=markdown_table(comparison))
    print("\n" + comparison.table)
    directory = args.plots or (args.json.parent if args.json else Path(args.run_root))
    for path in save_plots(comparison, directory):
        print(f"plot: {path}")
    if args.json:
        print(f"comparison: {comparison.save(args.json)}")
    return comparison


if __name__ == "__main__":
    main()
