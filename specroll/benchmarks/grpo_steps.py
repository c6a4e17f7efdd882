"""GRPO training steps with vanilla vs speculative rollouts, side by side in one run.

Two short training runs of the real driver (`specroll.train.run_training`: Ray actors,
DeepSpeed learner) that differ only in `rollout.mode`: same policy, prompts, seeds and
every other setting. Per step it prints generation and step seconds; at the end the
generation-time and end-to-end step-time ratios (vanilla / speculation, warm-up steps left
out), the generated-tokens-per-second ratio (steadier: response lengths differ), the share
of a step that generation takes, and whether the rewards of the two runs are
distinguishable: a two-proportion z-test on correct answers pooled over steps and a Welch
t-test on per-step mean rewards. Speculative sampling is exact, so the p-values
should be large; the two runs use different random draws, so the curves are not equal.

    python -m specroll.benchmarks.grpo_steps --policy ~/.cache/specroll/sft/gsm8k800 \
        --heads <heads file for that policy> --steps 4 [hydra overrides ...]

Extra arguments are Hydra overrides applied to both runs (e.g. `rollout.max_new_tokens=128`),
except `rollout.speculation.*` ones, which only the speculative run has (e.g. `rollout.speculation.budget=cost_model`).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

from ..command_line import compose_train_config
from ..telemetry import metric_names as m
from ..train import run_training
from .engine_vs_hf import DEFAULT_GSM8K

GSM8K_TRAIN = DEFAULT_GSM8K.with_name("train.jsonl")  # GRPO trains on train prompts

MODES = ("vanilla", "speculation")
SPEC_PREFIX = "rollout.speculation."  # overrides of the speculative settings apply to the speculation run only
COLUMNS = (("gen_s", m.TIME_GEN), ("step_s", m.STEP_TIME_S), ("reward", m.REWARD_MEAN),
           ("accuracy", m.ACCURACY), ("resp_len", m.RESPONSE_LENGTH_MEAN), ("tok/verify", m.TOKENS_PER_STEP))


def driver_settings(policy: str, dataset: str, data_path: str, prompts: int, n: int, max_new_tokens: int, steps: int,
                    seed: int, run_dir: Path) -> list[str]:
    """Hydra overrides of a short, fresh benchmark run of the driver (no checkpoints, no W&B)."""
    settings = [
        f"model.name={policy}",
        f"data={dataset}",
        f"data.prompts_per_step={prompts}", f"rollout.n={n}",
        f"rollout.max_new_tokens={max_new_tokens}", f"learner.max_response_len={max_new_tokens}",
        f"total_steps={steps}", "checkpoint_every=0", "logger=none", f"run_dir={run_dir}",
        f"seed={seed}", "resume=never",
    ]
    if dataset == "gsm8k":
        settings.append(f"data.path={data_path}")
    return settings


def run_driver(run_dir: Path, overrides: list[str], on_step_end=None) -> list[dict]:
    """Every step's metrics of `specroll.train.run_training` with `overrides`, in a fresh `run_dir`.
    `on_step_end(step, metrics, actors)` also sees each step."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a benchmark always starts fresh
    cfg = compose_train_config([f"run_dir={run_dir}", *overrides])
    steps: list[dict] = []

    def collect(step: int, metrics: dict, actors) -> None:
        steps.append(dict(metrics))
        if on_step_end is not None:
            on_step_end(step, metrics, actors)

    run_training(cfg, on_step_end=collect)
    return steps


def run_mode(mode: str, args, overrides: list[str]) -> list[dict]:
    run_dir = Path(args.run_root) / mode
    settings = driver_settings(args.policy, args.dataset, args.data_path, args.prompts, args.n, args.max_new_tokens,
                               args.steps, args.seed, run_dir) + [f"rollout={mode}"]
    if mode == "speculation":
        settings.append(f"rollout.speculation.heads_path={args.heads}")
    if mode != "speculation":  # vanilla rollouts have no spec section to override
        overrides = [o for o in overrides if not o.startswith(SPEC_PREFIX)]
    return run_driver(run_dir, settings + overrides)


def two_proportion_p(hits_a: float, n_a: float, hits_b: float, n_b: float) -> float:
    """Two-sided p-value of 'same success rate' for two binomial samples (normal approximation)."""
    pooled = (hits_a + hits_b) / (n_a + n_b)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n_a + 1 / n_b))
    if se == 0:
        return 1.0
    z = (hits_a / n_a - hits_b / n_b) / se
    return math.erfc(abs(z) / math.sqrt(2))


def welch_p(a: list[float], b: list[float]) -> float:
    """Two-sided p-value of Welch's t-test (scipy) of 'same mean'.

    With fewer than two values in a sample its variance is unknown and there is nothing to
    test: 1.0. With no spread in either sample the means are exact: 1.0 if equal, else 0.0.
    """
    from scipy.stats import ttest_ind

    if len(a) < 2 or len(b) < 2:
        return 1.0
    if max(a) == min(a) and max(b) == min(b):
        return 1.0 if a[0] == b[0] else 0.0  # scipy gives nan for equal constants (t = 0 / 0)
    return float(ttest_ind(a, b, equal_var=False).pvalue)


def summarize(results: dict[str, list[dict]], warmup: int) -> dict:
    def total(mode, name):
        return sum(s.get(name, 0.0) for s in results[mode][warmup:])

    summary = {
        "gen_ratio": total("vanilla", m.TIME_GEN) / max(total("speculation", m.TIME_GEN), 1e-9),
        "step_ratio": total("vanilla", m.STEP_TIME_S) / max(total("speculation", m.STEP_TIME_S), 1e-9),
    }
    # Per generated token: the two runs sample different responses, and with few steps their
    # lengths alone move the time ratios.
    for mode in MODES:
        tokens = sum(s[m.RESPONSE_LENGTH_MEAN] * s[m.NUM_SEQUENCES] for s in results[mode][warmup:])
        summary[f"{mode}_gen_tokens_per_s"] = tokens / max(total(mode, m.TIME_GEN), 1e-9)
    summary["gen_tokens_per_s_ratio"] = summary["speculation_gen_tokens_per_s"] / max(summary["vanilla_gen_tokens_per_s"], 1e-9)
    for mode in MODES:
        summary[f"{mode}_gen_share"] = total(mode, m.TIME_GEN) / max(total(mode, m.STEP_TIME_S), 1e-9)
        summary[f"{mode}_responses"] = sum(s[m.NUM_SEQUENCES] for s in results[mode])
        summary[f"{mode}_correct"] = sum(s[m.ACCURACY] * s[m.NUM_SEQUENCES] for s in results[mode])
        summary[f"{mode}_reward_mean"] = (sum(s[m.REWARD_MEAN] * s[m.NUM_SEQUENCES] for s in results[mode])
                                          / summary[f"{mode}_responses"])
    summary["accuracy_p"] = two_proportion_p(summary["vanilla_correct"], summary["vanilla_responses"],
                                             summary["speculation_correct"], summary["speculation_responses"])
    summary["reward_welch_p"] = welch_p([s[m.REWARD_MEAN] for s in results["vanilla"]],
                                        [s[m.REWARD_MEAN] for s in results["speculation"]])
    return summary


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="smollm2-135m-instruct", help="alias or HF directory (e.g. an SFT output)")
    ap.add_argument("--heads", default="shipped", help="heads file for the policy, 'shipped', or 'null' (untrained)")
    ap.add_argument("--dataset", default="gsm8k", choices=("gsm8k", "synthetic"), help="prompts and rewards")
    ap.add_argument("--data-path", default=str(GSM8K_TRAIN), help="GSM8K jsonl file or folder")
    ap.add_argument("--steps", type=int, default=4, help="training steps per mode")
    ap.add_argument("--warmup-steps", type=int, default=1, help="first steps left out of the ratios")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--n", type=int, default=8, help="responses per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-root", default="runs/bench_grpo_steps", help="each mode's run_dir goes under it")
    ap.add_argument("--json", type=Path, default=None, help="also write every step's metrics and the summary here")
    args, overrides = ap.parse_known_args(argv)
    if args.warmup_steps >= args.steps:
        ap.error(f"--warmup-steps ({args.warmup_steps}) must be below --steps ({args.steps})")
    bad = [o for o in overrides if "=" not in o]
    if bad:
        ap.error(f"unknown arguments {bad}; extra arguments must be Hydra overrides key=value")

    results = {mode: run_mode(mode, args, overrides) for mode in MODES}

    print(f"\n{args.prompts} prompts x {args.n} responses, max {args.max_new_tokens} new tokens, "
          f"policy {args.policy}, heads {args.heads}")
    print("mode      step " + " ".join(f"{name:>10}" for name, _ in COLUMNS))
    for mode in MODES:
        for step, metrics in enumerate(results[mode]):
            values = " ".join(f"{metrics.get(key, float('nan')):>10.3f}" for _, key in COLUMNS)
            print(f"{mode:<9} {step:>4} {values}")
    summary = summarize(results, args.warmup_steps)
    print(f"\nsteps {args.warmup_steps}..{args.steps - 1} (first {args.warmup_steps} left out as warm-up):")
    print(f"  generation time ratio (vanilla / speculation): {summary['gen_ratio']:.2f}x")
    print(f"  step time ratio (vanilla / speculation):       {summary['step_ratio']:.2f}x")
    print(f"  generated tokens/s ratio (speculation / vanilla): {summary['gen_tokens_per_s_ratio']:.2f}x "
          f"({summary['speculation_gen_tokens_per_s']:.1f} vs {summary['vanilla_gen_tokens_per_s']:.1f} tok/s)")
    print(f"  generation share of a step: vanilla {summary['vanilla_gen_share']:.0%}, "
          f"speculation {summary['speculation_gen_share']:.0%}")
    print(f"rewards over all steps: vanilla {summary['vanilla_reward_mean']:.3f} "
          f"({summary['vanilla_correct']:.0f}/{summary['vanilla_responses']:.0f} correct), speculation "
          f"{summary['speculation_reward_mean']:.3f} ({summary['speculation_correct']:.0f}/"
          f"{summary['speculation_responses']:.0f} correct)")
    print(f"  same accuracy? two-proportion z-test p = {summary['accuracy_p']:.3f}; "
          f"per-step mean rewards, Welch t-test p = {summary['reward_welch_p']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "overrides": overrides,
                                         "steps": results, "summary": summary}, indent=1))
    return summary


if __name__ == "__main__":
    main()
