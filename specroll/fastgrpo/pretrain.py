"""Pretraining of the FastGRPO-style drafter on the policy's own samples (the heads' samples cache).

The frozen policy's samples come from `speculation.head_samples` (the same cache file as
`python -m specroll.speculation.head_training.training` with the same sampling settings); one teacher-forced
pass gives the features, and the drafter trains with the online loss (`fastgrpo.loss`) for a
few epochs. Its quality is measured as tokens per verify pass of the FastGRPO decoder on
held-out prompts, at a fixed tree size, before and after training.

    python -m specroll.fastgrpo.pretrain --model smollm2-135m-instruct --dataset gsm8k,synthetic \
        --data-path ../shared/data/gsm8k/train.jsonl --positions 20000 --epochs 3 --save-dtype bfloat16 \
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

from specroll.speculation.head_training.samples import SampleConfig, SampledSequence, heldout_prompts, split_heldout

from ..configs.cli import add_config_arguments, config_from_args
from ..rollout import RolloutEngine, SamplingParams
from .config import FastGRPOConfig, OnlineConfig
from .decoder import FastGRPODecoder
from .drafter import FeatureDrafter
from .feature_log import DraftSequences, teacher_forced_sequences
from .online import OnlineDrafterLearner


def sample_features(model, sequences: list[SampledSequence], batch_tokens: int = 8192) -> DraftSequences:
    return teacher_forced_sequences(model, [list(s.ids[: s.prompt_len]) for s in sequences],
                                    [list(s.ids[s.prompt_len :]) for s in sequences], batch_tokens)


def pretrain_drafter(model, drafter: FeatureDrafter, train: DraftSequences, epochs: int, cfg: OnlineConfig,
                     heldout: DraftSequences | None = None, log=print) -> dict:
    """Train `drafter` in place for `epochs` passes over `train`; returns losses per epoch (held-out
    losses too, epoch 0 = before training). The drafter's online update count stays 0."""
    learner = OnlineDrafterLearner(drafter, model, cfg)
    heldout_loss = [learner.loss(heldout)] if heldout is not None else []
    train_loss = []
    for epoch in range(1, epochs + 1):
        update = learner.update(train)
        train_loss.append(update.loss)
        if heldout is not None:
            heldout_loss.append(learner.loss(heldout))
        log(f"epoch {epoch}: train loss {update.loss:.4f}" + (f", held-out {heldout_loss[-1]:.4f}" if heldout else "")
            + f" ({update.seconds:.0f}s)")
    learner.master.updates = 0
    learner.publish()
    return {"train_loss": train_loss, "heldout_loss": heldout_loss}


def tokens_per_pass(model, drafter: FeatureDrafter, prompts: list[list[int]], nodes: int, n: int,
                    max_new_tokens: int, seed: int = 0) -> dict:
    """The FastGRPO decoder's tokens per verify pass and acceptance by depth on `prompts`, N = `nodes` fixed."""
    cfg = FastGRPOConfig(drafter_path=None, capacity=nodes * len(prompts) * n, max_nodes=nodes,
                         online=OnlineConfig(enabled=False))
    engine = RolloutEngine(model, decoder=FastGRPODecoder(model, cfg))
    engine.decoder.set_drafter(drafter)
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, n=n, seed=seed))
    return {"nodes": nodes, "tokens_per_pass": out.stats.tree.tokens_per_step_mean,
            "acceptance_by_depth": out.stats.tree.acceptance_by_depth, "responses": len(out.token_ids),
            "tokens": out.stats.tokens}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specroll.fastgrpo.pretrain", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias, .gguf file or model directory")
    p.add_argument("--dataset", default="synthetic", help="problem set(s) to prompt with, comma-separated: synthetic, gsm8k")
    p.add_argument("--data-path", default=None, help="gsm8k jsonl file or folder")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (online learning uses 1e-4)")
    p.add_argument("--batch-tokens", type=int, default=1024, help="training entries per optimiser step")
    p.add_argument("--heldout-every", type=int, default=20, help="every n-th prompt is held out for evaluation")
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts the tokens-per-pass check answers")
    p.add_argument("--eval-n", type=int, default=2, help="responses per held-out prompt in that check")
    p.add_argument("--eval-nodes", type=int, default=8, help="tree nodes per response (root included) in that check")
    p.add_argument("--eval-max-new-tokens", type=int, default=128)
    p.add_argument("--samples-cache", default=None, help="folder of sample caches (default ~/.cache/specroll/head_samples)")
    p.add_argument("--init-drafter", default=None, help="start from this drafter file instead of a fresh one")
    p.add_argument("--out", required=True, help="drafter file (.safetensors); the summary goes beside it (.json)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="policy dtype")
    p.add_argument("--save-dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0, help="the samples' and the training's seed")
    # The heads' sampling settings but for fewer positions, so both read the same samples cache.
    add_config_arguments(p, SampleConfig, exclude=("temperature", "seed"), defaults={"positions": 20_000})
    args = p.parse_args(argv)
    args.sample_config = config_from_args(SampleConfig, args, p)
    return args


def main(argv: list[str] | None = None) -> dict:
    from specroll.speculation.head_training.training import dataset_names, samples_from_args

    from ..models import load_causal_lm

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
        "command": " ".join(["python -m specroll.fastgrpo.pretrain"] + (sys.argv[1:] if argv is None else argv)),
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
