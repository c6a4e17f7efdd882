"""Pretraining of the FastGRPO-style drafter on the policy's own samples (the heads' samples cache).

Trains a drafter (`specroll.fastgrpo.pretrain`) on `--model`'s samples and reports tokens per
verify pass on held-out prompts before and after; saves it with a summary beside it:

    python -m specroll.tools.pretrain_drafter --model smollm2-135m-instruct --dataset gsm8k,synthetic \
        --data-path $GSM8K/train.jsonl --positions 20000 --epochs 3 --save-dtype bfloat16 \
        --out specroll/assets/drafters/smollm2-135m-instruct.drafter.safetensors
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from specroll.fastgrpo import FeatureDrafter, OnlineConfig
from specroll.fastgrpo.pretrain import pretrain_drafter, sample_features, tokens_per_pass
from specroll.models import load_causal_lm
from specroll.speculation.head_training.samples import SampleConfig, heldout_prompts, split_heldout

from .flags import add_common_flags, config_from_args
from .policy_samples import add_sample_flags, dataset_names, samples_from_args

COMMAND = "python -m specroll.tools.pretrain_drafter"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    add_common_flags(p, out_help="drafter file (.safetensors); the summary goes beside it (.json)", out_required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (online learning uses 1e-4)")
    p.add_argument("--batch-tokens", type=int, default=1024, help="training entries per optimiser step")
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts the tokens-per-pass check answers")
    p.add_argument("--eval-n", type=int, default=2, help="responses per held-out prompt in that check")
    p.add_argument("--eval-nodes", type=int, default=8, help="tree nodes per response (root included) in that check")
    p.add_argument("--eval-max-new-tokens", type=int, default=128)
    p.add_argument("--init-drafter", default=None, help="start from this drafter file instead of a fresh one")
    p.add_argument("--save-dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    # The heads' sampling settings but for fewer positions, so both read the same samples cache.
    add_sample_flags(p, defaults={"positions": 20_000})
    args = p.parse_args(argv)
    args.sample_config = config_from_args(SampleConfig, args, p)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    model, tokenizer = load_causal_lm(args.model, dtype=args.dtype, device=args.device)
    model.requires_grad_(False)
    started = time.perf_counter()
    prompts, samples, sample_cfg, _ = samples_from_args(model, tokenizer, args)
    held = heldout_prompts(len(prompts), args.seed, args.heldout_every)
    train_seqs, heldout_seqs = split_heldout(samples.sequences, held)
    train, heldout = sample_features(model, train_seqs), sample_features(model, heldout_seqs) if heldout_seqs else None
    print(f"features of {train.num_entries} training entries ({time.perf_counter() - started:.0f}s so far)")
    drafter = (FeatureDrafter.load(args.init_drafter, model) if args.init_drafter
               else FeatureDrafter.for_model(model, seed=args.seed))
    # Held-out prompts never sampled above (a small cache holds few of them) are fine for the speed check.
    eval_prompts = [prompts[i] for i in sorted(held)][: args.eval_prompts]
    check = dict(nodes=args.eval_nodes, n=args.eval_n, max_new_tokens=args.eval_max_new_tokens, seed=args.seed)
    start = args.init_drafter or "untrained"
    before = tokens_per_pass(model, drafter, eval_prompts, **check)  # the drafter training starts from
    cfg = OnlineConfig(lr=args.lr, batch_tokens=args.batch_tokens)
    losses = pretrain_drafter(model, drafter, train, args.epochs, cfg, heldout)
    after = tokens_per_pass(model, drafter, eval_prompts, **check)
    print(f"tokens per verify pass at {args.eval_nodes} nodes on {len(eval_prompts)} held-out prompts: "
          f"before ({start}) {before['tokens_per_pass']:.3f}, after {after['tokens_per_pass']:.3f}; "
          "acceptance by depth "
          + " ".join(f"{a:.2f}" for a in after["acceptance_by_depth"]))
    out = Path(args.out)
    drafter.save(out, dtype=getattr(torch, args.save_dtype))
    summary = {
        "command": " ".join([COMMAND] + (sys.argv[1:] if argv is None else argv)),
        "model": args.model, "datasets": dataset_names(args.dataset), "data_path": args.data_path,
        "sample_config": asdict(sample_cfg), "samples_cache": str(samples.path),
        "train_entries": train.num_entries, "heldout_entries": heldout.num_entries if heldout else 0,
        "train_config": asdict(cfg), "epochs": args.epochs, **losses,
        "init_drafter": args.init_drafter, "check_before": before, "check_after": after, "save_dtype": args.save_dtype,
        "wall_time_s": time.perf_counter() - started,
    }
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"saved the drafter to {out} and its summary to {out.with_suffix('.json')}")
    return summary


if __name__ == "__main__":
    main()
