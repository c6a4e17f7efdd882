"""Supervised warm start: fine-tune the policy on reference worked solutions before GRPO.

Trains `--model` on a problem set's worked solutions (`specroll.learner.sft_trainer`), evaluates it on
held-out ones before and after, and saves it as a Hugging Face directory with its summary:

    python -m specroll.tools.sft --model smollm2-135m-instruct --dataset gsm8k \
        --data-path $GSM8K/train.jsonl --limit 800 --epochs 2 --out ~/.cache/specroll/sft/gsm8k800
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from specroll.data import load_problems
from specroll.learner.sft_trainer import (
    SUMMARY_FILE,
    SFTConfig,
    build_examples,
    default_out,
    finished_summary,
    model_identity,
    problems_digest,
    save_result,
    split_problems,
    train_sft,
)
from specroll.models import load_causal_lm

from .flags import add_common_flags, add_config_arguments, config_from_args

COMMAND = "python -m specroll.tools.sft"


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, SFTConfig]:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    # The recipe sets the device and keeps float32 weights; the common --seed is its seed.
    out_help = "output HF directory (default ~/.cache/specroll/sft/<model>-<dataset><limit>-e<epochs>)"
    add_common_flags(p, out_help, one_dataset=True, dtypes=None)
    p.add_argument("--limit", type=int, default=None, help="train on the first N problems (after holding out)")
    p.add_argument("--skip", type=int, default=0,
                   help="leave out the first N problems before --limit counts (those a benchmark prompts with)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice; 1 is fastest on an oversubscribed CPU)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_arguments(p, SFTConfig, exclude=("seed",))
    args = p.parse_args(argv)
    return args, config_from_args(SFTConfig, args, p)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args, cfg = parse_args(argv)
    if args.dataset == "gsm8k" and args.data_path is None:
        raise ValueError("--data-path is required for gsm8k (runs download nothing)")
    problems = load_problems(args.dataset, path=args.data_path)
    train_problems, heldout_problems = split_problems(problems, cfg.eval_examples, args.limit, args.skip)
    out = Path(args.out).expanduser() if args.out else default_out(args.model, args.dataset, args.limit, cfg.epochs)
    recipe = {
        "model": model_identity(args.model),
        "dataset": args.dataset,
        "train_digest": problems_digest(train_problems),
        "heldout_digest": problems_digest(heldout_problems),
        "config": asdict(cfg),
    }
    done = finished_summary(out, recipe)
    if done is not None:
        print(f"SFT result for this recipe already in {out} (summary: {out / SUMMARY_FILE}); skipping")
        return done

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_causal_lm(args.model, dtype="float32", device=cfg.device)
    print(f"SFT of {args.model} on {len(train_problems)} {args.dataset} solutions, {len(heldout_problems)} held out; "
          f"output {out}", flush=True)
    result = train_sft(
        model,
        build_examples(tokenizer, train_problems),
        build_examples(tokenizer, heldout_problems),
        cfg,
        progress=not args.no_progress,
    )
    summary = {
        "command": " ".join([COMMAND] + (sys.argv[1:] if argv is None else list(argv))),
        "recipe": recipe,
        **result.metrics,
    }
    save_result(result.module, tokenizer, summary, out)
    before, after = summary["eval_before"], summary["eval_after"]
    print(f"entropy {before['entropy']:.3f} -> {after['entropy']:.3f} nats, top-1 prob {before['top1_prob']:.3f} -> "
          f"{after['top1_prob']:.3f}, nll/token {before['nll']:.3f} -> {after['nll']:.3f}")
    print(f"saved the policy and {SUMMARY_FILE} to {out}")
    return summary


if __name__ == "__main__":
    main()
