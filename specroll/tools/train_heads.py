"""Head pretraining by self-distillation on the policy's own samples (docs/algorithm.md, section 1).

Draws (or reads from the cache) `--model`'s samples, trains horizon heads on them
(`specroll.speculation.head_training`) and saves the heads with a summary beside them:

    python -m specroll.tools.train_heads --model smollm2-135m-instruct --dataset gsm8k,synthetic \
        --data-path $GSM8K/train.jsonl --out heads.safetensors
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from specroll.models import load_causal_lm
from specroll.speculation.drafting.heads import HEAD_TYPES, SHIPPED_HEADS, HorizonHeads, shipped_heads
from specroll.speculation.head_training.samples import SampleConfig, frequent_tokens, heldout_prompts, split_heldout
from specroll.speculation.head_training.training import HeadTrainConfig, evaluate_heads, train_heads

from .flags import add_common_flags, add_config_arguments, config_from_args
from .policy_samples import PolicySamples, add_sample_flags, dataset_names, samples_from_args

COMMAND = "python -m specroll.tools.train_heads"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    add_common_flags(p, out_help="heads file (.safetensors); the summary goes beside it (.json); not needed with "
                                 "--collect-only")
    p.add_argument("--head-type", choices=HEAD_TYPES, default="path")
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--head-layers", type=int, default=None,
                   help="layers per head (default: 1, or those of --init-heads, which are deepened if fewer)")
    p.add_argument("--init-heads", default=None,
                   help="start from these heads instead of fresh ones: a heads file, or a model alias whose shipped "
                        "heads to take (e.g. smollm2-135m-instruct when training heads for its SFT'd policy)")
    # A confident draft is a frequent token: a small draft vocabulary drafts as well, for less drafting time.
    p.add_argument("--draft-vocab", type=int, default=1024,
                   help="heads draft among this many of the samples' most frequent tokens; 0 = the whole vocabulary")
    p.add_argument("--epochs", type=int, default=HeadTrainConfig.epochs,
                   help="passes over the training positions; 0: no training, only the held-out evaluation of the "
                        "given heads (see --init-heads)")
    p.add_argument("--save-dtype", choices=("float32", "bfloat16"), default="float32", help="dtype of the saved heads")
    p.add_argument("--collect-only", action="store_true", help="only fill the samples cache, train nothing")
    add_sample_flags(p)
    add_config_arguments(p, HeadTrainConfig, exclude=("epochs", "eval_ks", "seed"))
    args = p.parse_args(argv)
    if args.out is None and not args.collect_only:
        p.error("--out is required (where to save the heads) unless --collect-only")
    if args.epochs < 0:
        p.error(f"--epochs must be >= 0, got {args.epochs}")
    if args.draft_vocab < 0:
        p.error(f"--draft-vocab must be >= 0, got {args.draft_vocab}")
    args.sample_config = config_from_args(SampleConfig, args, p)
    # With --epochs 0 the other fields still set the evaluation.
    args.train_config = config_from_args(HeadTrainConfig, args, p, epochs=max(args.epochs, 1))
    return args


def init_heads_path(init_heads: str) -> Path:
    """`--init-heads`: a model alias means that model's shipped heads, anything else a file."""
    return shipped_heads(init_heads) if init_heads in SHIPPED_HEADS else Path(init_heads)


def initial_heads(model, args: argparse.Namespace) -> HorizonHeads:
    """Fresh heads, or a warm start from `--init-heads` (same type and count as asked; deepened
    with untrained layers if `--head-layers` asks for more than they have)."""
    if args.head_layers is not None and args.head_layers < 1:
        raise ValueError(f"--head-layers must be >= 1, got {args.head_layers}")
    if args.init_heads is None:
        return HorizonHeads.for_model(model, args.head_type, args.num_heads, args.head_layers or 1)
    path = init_heads_path(args.init_heads)
    heads = HorizonHeads.load(path, model)
    if (heads.head_type, heads.num_heads) != (args.head_type, args.num_heads):
        raise ValueError(f"--init-heads {path} holds {heads.num_heads} {heads.head_type} heads, but --head-type "
                         f"{args.head_type} --num-heads {args.num_heads} were asked for")
    if args.head_layers is not None and args.head_layers != heads.num_layers:
        if args.head_layers < heads.num_layers:
            raise ValueError(f"--init-heads {path} has {heads.num_layers} layers per head; --head-layers "
                             f"{args.head_layers} would drop trained ones")
        heads = heads.deepened(args.head_layers)
    heads.base_model_name = model.config.name  # trained for this policy from here on
    return heads


def init_heads_summary(init_heads: str | None) -> dict | None:
    """The summary saved beside the `--init-heads` heads, to keep how the starting heads were made."""
    if init_heads is None:
        return None
    summary_path = init_heads_path(init_heads).with_suffix(".json")
    return json.loads(summary_path.read_text()) if summary_path.is_file() else None


def heads_summary(args: argparse.Namespace, argv: list[str] | None, heads: HorizonHeads, drawn: PolicySamples,
                  heldout_sequences: int, metrics: dict, init_summary: dict | None) -> dict:
    """What the saved heads' json records: the command, the samples, the training and its metrics."""
    return {
        "command": " ".join([COMMAND] + (sys.argv[1:] if argv is None else argv)),
        "model": args.model,
        "datasets": dataset_names(args.dataset),
        "data_path": args.data_path,
        "head_type": args.head_type,
        "num_heads": args.num_heads,
        "head_layers": heads.num_layers,
        "heads_version": heads.version,
        "draft_vocab": 0 if heads.draft_vocab is None else int(heads.draft_vocab.numel()),
        "sample_config": asdict(drawn.config),
        "samples_cache": str(drawn.samples.path),
        "sample_positions": sum(s.response_len for s in drawn.samples.sequences),
        "sample_time_s": drawn.seconds,
        "heldout_sequences": heldout_sequences,
        "train_config": None if args.epochs == 0 else asdict(args.train_config),
        **{k: v for k, v in metrics.items() if k != "train_loss"},
        "train_loss_every_10": metrics.get("train_loss", [])[::10],
        "init_heads": args.init_heads,
        "init_summary": init_summary,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    model, tokenizer = load_causal_lm(args.model, dtype=args.dtype, device=args.device)
    model.requires_grad_(False)
    drawn = samples_from_args(model, tokenizer, args)
    if args.collect_only:
        return {"samples_cache": str(drawn.samples.path), "sequences": len(drawn.samples.sequences)}
    held = heldout_prompts(len(drawn.prompts), args.seed, args.heldout_every)
    train_seqs, heldout = split_heldout(drawn.samples.sequences, held)
    heads = initial_heads(model, args)
    heads.set_draft_vocab(frequent_tokens(train_seqs, args.draft_vocab) if args.draft_vocab else None)
    if args.epochs == 0:  # evaluate only: e.g. existing heads given a draft vocabulary
        metrics = evaluate_heads(model, heads, heldout, args.train_config)
    else:
        metrics = train_heads(model, heads, train_seqs, args.train_config, heldout)
    out = Path(args.out)
    init_summary = init_heads_summary(args.init_heads)  # read before saving: --out may be the starting heads
    heads.save(out, dtype=getattr(torch, args.save_dtype))
    summary = heads_summary(args, argv, heads, drawn, len(heldout), metrics, init_summary)
    summary_path = out.with_suffix(".json")
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"saved heads to {out} and summary to {summary_path}")
    return summary


if __name__ == "__main__":
    main()
