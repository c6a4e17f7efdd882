"""Head pretraining by self-distillation on the policy's own samples (SPECROLL.md section 1).

The frozen policy's samples (`head_samples`) give distillation targets (`distill_targets`);
the heads learn them with the loss and step shared with the slow path (`head_loss`) and are
evaluated on held-out prompts (`head_eval`).
Heads with a draft vocabulary (the tokens drafting proposes from) train on it alone: p and
q are both taken over the draft vocabulary, i.e. q learns exactly what drafting uses
(the policy's distribution restricted to those tokens), and a step multiplies a few
thousand LM-head rows instead of SmolLM2's 49k. A sampled token outside the draft
vocabulary gives no NLL term.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from specroll.configs.cli import add_config_arguments, config_from_args

from ..drafting.heads import HEAD_TYPES, SHIPPED_HEADS, HorizonHeads, shipped_heads
from .evaluation import evaluate, format_eval
from .loss import HeadBatch, HeadLossConfig, train_step
from .samples import SampleConfig, SampledSequence, collect_samples, frequent_tokens, heldout_prompts, split_heldout
from .targets import compute_targets

# -- training -------------------------------------------------------------------------------

@dataclass
class HeadTrainConfig:
    """How the heads train on the policy's samples, and how often they are evaluated on held-out ones."""

    epochs: int = 3  # passes over the training positions
    lr: float = 1e-3  # AdamW peak learning rate, cosine-decayed to zero
    weight_decay: float = 0.0  # AdamW weight decay
    batch_positions: int = 512  # positions per optimiser step
    chunk_positions: int = 512  # positions per LM-head evaluation (memory: chunk x vocab floats)
    head_decay: float = 0.8  # w_k = head_decay^(k-1)
    nll_weight: float = 0.3  # weight of the realised-token NLL next to the KL
    target_top_k: int = 64  # K of the sparse target distribution (top-K + tail bucket)
    max_grad_norm: float = 1.0  # gradient clipping
    eval_every: int = 200  # optimiser steps between held-out evaluations
    eval_positions: int = 4096  # held-out positions evaluated (the first ones)
    eval_ks: tuple[int, ...] = (4, 8)  # k of top-k agreement and covered target mass
    policy_batch_tokens: int = 8192  # tokens per policy forward when computing targets
    seed: int = 0  # shuffling of positions

    def __post_init__(self) -> None:
        self.eval_ks = tuple(self.eval_ks)
        for name in ("epochs", "batch_positions", "chunk_positions", "target_top_k", "eval_every",
                     "eval_positions", "policy_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"HeadTrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"HeadTrainConfig.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0 or self.nll_weight < 0 or self.max_grad_norm <= 0:
            raise ValueError("HeadTrainConfig.weight_decay and nll_weight must be >= 0, max_grad_norm > 0")
        if not 0 < self.head_decay <= 1:
            raise ValueError(f"HeadTrainConfig.head_decay must be in (0, 1], got {self.head_decay}")
        if not self.eval_ks or min(self.eval_ks) < 1:
            raise ValueError(f"HeadTrainConfig.eval_ks must be positive ints, got {self.eval_ks}")

    @property
    def loss(self) -> HeadLossConfig:
        """Pretraining's loss: distillation KL + nll_weight NLL, no proximal term."""
        return HeadLossConfig(distill_weight=1.0, nll_weight=self.nll_weight, proximal_weight=0.0,
                              head_decay=self.head_decay, chunk_positions=self.chunk_positions)


def evaluate_heads(model, heads: HorizonHeads, eval_sequences: list[SampledSequence], cfg: HeadTrainConfig,
                   progress: bool = True, log=print) -> dict:
    """The held-out evaluation of `train_heads` without any training (e.g. after setting a draft vocabulary)."""
    started = time.perf_counter()
    dtype = next(heads.parameters()).dtype
    targets = compute_targets(model, eval_sequences, cfg.target_top_k, cfg.policy_batch_tokens, cfg.chunk_positions,
                              progress)
    result = evaluate(heads.float(), model.lm_head.weight.detach().float(), model.embed_tokens.weight.detach().float(),
                      targets, cfg.loss, cfg.eval_positions, cfg.eval_ks)
    heads.to(dtype)
    result["step"] = 0
    log(f"held-out eval:\n{format_eval(result, cfg.eval_ks)}")
    return {"eval_positions": result["per_head"][0]["count"], "steps": 0, "eval": [result],
            "wall_time_s": time.perf_counter() - started}


def train_heads(model, heads: HorizonHeads, sequences: list[SampledSequence], cfg: HeadTrainConfig,
                eval_sequences: list[SampledSequence] | None = None, progress: bool = True,
                log=print) -> dict:
    """Train `heads` in place on the policy's samples; the policy stays frozen.

    Heads train in float32 whatever the policy's dtype and are cast back at the end.
    Returns the metrics: positions trained on, step losses, held-out evaluations (step 0 =
    the heads as given).
    """
    started = time.perf_counter()
    model_dtype = next(heads.parameters()).dtype
    heads.float().train()
    lm_head = model.lm_head.weight.detach().float()
    embed = model.embed_tokens.weight.detach().float()
    # Training sees what drafting sees: the draft vocabulary only (held-out evaluation: all tokens).
    train = compute_targets(model, sequences, cfg.target_top_k, cfg.policy_batch_tokens, cfg.chunk_positions, progress,
                            vocab=heads.draft_vocab)
    train_lm_head = heads.draft_lm_head(lm_head)
    heldout = (compute_targets(model, eval_sequences, cfg.target_top_k, cfg.policy_batch_tokens,
                               cfg.chunk_positions, progress) if eval_sequences else None)
    # Positions where at least head 1 has a target inside the response.
    positions = (train.remaining >= 1).nonzero()[:, 0]
    if positions.numel() == 0:
        raise ValueError("no training positions: every sampled response is shorter than 2 tokens")
    steps_per_epoch = math.ceil(positions.numel() / cfg.batch_positions)
    total_steps = cfg.epochs * steps_per_epoch
    optimizer = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / total_steps)))
    generator = torch.Generator().manual_seed(cfg.seed)
    evals, losses = [], []

    def run_eval(step: int) -> None:
        if heldout is None:
            return
        result = evaluate(heads, lm_head, embed, heldout, cfg.loss, cfg.eval_positions, cfg.eval_ks)
        result["step"] = step
        evals.append(result)
        log(f"held-out eval at step {step}:\n{format_eval(result, cfg.eval_ks)}")

    run_eval(0)
    bar = tqdm(total=total_steps, desc="heads", unit="step", disable=not progress)
    step, ema = 0, None
    for _ in range(cfg.epochs):
        perm = torch.randperm(positions.numel(), generator=generator, device=generator.device)
        perm = positions[perm.to(positions.device)]
        for b in range(steps_per_epoch):
            batch = HeadBatch.from_targets(train, perm[b * cfg.batch_positions: (b + 1) * cfg.batch_positions],
                                           heads.num_heads, embed)
            optimizer.zero_grad(set_to_none=True)
            loss = train_step(heads, train_lm_head, batch, cfg.loss)
            torch.nn.utils.clip_grad_norm_(heads.parameters(), cfg.max_grad_norm)
            optimizer.step()
            schedule.step()
            step += 1
            losses.append(loss)
            ema = loss if ema is None else 0.95 * ema + 0.05 * loss
            bar.update(1)
            bar.set_postfix(loss=f"{ema:.4f}", lr=f"{schedule.get_last_lr()[0]:.2e}")
            if step % cfg.eval_every == 0 and step < total_steps:
                run_eval(step)
    bar.close()
    run_eval(step)
    heads.to(model_dtype).eval()
    return {
        "train_positions": int(positions.numel()),
        "train_sequences": len(sequences),
        "eval_positions": evals[-1]["per_head"][0]["count"] if evals else 0,
        "steps": step,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "train_loss": losses,
        "eval": evals,
        "wall_time_s": time.perf_counter() - started,
    }


# -- command line ---------------------------------------------------------------------------

def dataset_names(datasets: str) -> list[str]:
    """`--dataset gsm8k,synthetic` as a list of names."""
    return [n.strip() for n in datasets.split(",") if n.strip()]


def dataset_prompts(tokenizer, names: list[str], data_path: str | None) -> list[list[int]]:
    from specroll.data import format_prompt, load_problems

    prompts = []
    for name in names:
        problems = load_problems(name, path=data_path if name == "gsm8k" else None)
        prompts.extend(format_prompt(tokenizer, p.question) for p in problems)
    return prompts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specroll.speculation.head_training.training", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias, .gguf file or model directory")
    p.add_argument("--dataset", default="synthetic",
                   help="problem set(s) to prompt with, comma-separated: synthetic, gsm8k")
    p.add_argument("--data-path", default=None, help="gsm8k jsonl file or folder")
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
    p.add_argument("--heldout-every", type=int, default=20, help="every n-th prompt is held out for evaluation")
    p.add_argument("--out", default=None,
                   help="heads file (.safetensors); the summary goes beside it (.json); not needed with --collect-only")
    p.add_argument("--samples-cache", default=None,
                   help="folder of sample caches (default ~/.cache/specroll/head_samples)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="policy dtype")
    p.add_argument("--save-dtype", choices=("float32", "bfloat16"), default="float32", help="dtype of the saved heads")
    p.add_argument("--device", default="auto")
    p.add_argument("--collect-only", action="store_true", help="only fill the samples cache, train nothing")
    p.add_argument("--seed", type=int, default=0, help="the samples' and the training's seed")
    # At the policy's own temperature: the heads learn what it samples.
    add_config_arguments(p, SampleConfig, exclude=("temperature", "seed"))
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


class ArgSamples(NamedTuple):
    prompts: list[list[int]]
    samples: object  # head_samples.collect_samples's result
    config: SampleConfig
    seconds: float  # spent sampling (0-ish when the cache held them)


def samples_from_args(model, tokenizer, args) -> ArgSamples:
    """The prompts and the policy's samples (cached) that a pretraining command's arguments name:
    --dataset, --data-path, --samples-cache and the SampleConfig parsed from its flags. The heads
    and the FastGRPO-style drafter read the same samples."""
    prompts = dataset_prompts(tokenizer, dataset_names(args.dataset), args.data_path)
    sample_cfg = args.sample_config
    started = time.perf_counter()
    samples = collect_samples(model, prompts, sample_cfg, args.samples_cache)
    seconds = time.perf_counter() - started
    print(f"{len(samples.sequences)} sequences from {samples.path} ({samples.new_batches} batches generated "
          f"in {seconds:.0f}s)")
    return ArgSamples(prompts, samples, sample_cfg, seconds)


def main(argv: list[str] | None = None) -> dict:
    from specroll.models import load_causal_lm

    args = parse_args(argv)
    torch.manual_seed(args.seed)
    model, tokenizer = load_causal_lm(args.model, dtype=args.dtype, device=args.device)
    model.requires_grad_(False)
    prompts, samples, sample_cfg, sample_time = samples_from_args(model, tokenizer, args)
    if args.collect_only:
        return {"samples_cache": str(samples.path), "sequences": len(samples.sequences)}
    train_seqs, heldout = split_heldout(samples.sequences, heldout_prompts(len(prompts), args.seed, args.heldout_every))
    heads = initial_heads(model, args)
    heads.set_draft_vocab(frequent_tokens(train_seqs, args.draft_vocab) if args.draft_vocab else None)
    cfg = args.train_config
    if args.epochs == 0:  # evaluate only: e.g. existing heads given a draft vocabulary
        metrics = evaluate_heads(model, heads, heldout, cfg)
    else:
        metrics = train_heads(model, heads, train_seqs, cfg, heldout)
    out = Path(args.out)
    init_summary = None
    if args.init_heads is not None:  # keep how the starting heads were made
        init_path = init_heads_path(args.init_heads)
        if init_path.with_suffix(".json").is_file():
            init_summary = json.loads(init_path.with_suffix(".json").read_text())
    heads.save(out, dtype=getattr(torch, args.save_dtype))
    summary = {
        "command": " ".join(["python -m specroll.speculation.head_training.training"] + (sys.argv[1:] if argv is None else argv)),
        "model": args.model,
        "datasets": dataset_names(args.dataset),
        "data_path": args.data_path,
        "head_type": args.head_type,
        "num_heads": args.num_heads,
        "head_layers": heads.num_layers,
        "heads_version": heads.version,
        "draft_vocab": 0 if heads.draft_vocab is None else int(heads.draft_vocab.numel()),
        "sample_config": asdict(sample_cfg),
        "samples_cache": str(samples.path),
        "sample_positions": sum(s.response_len for s in samples.sequences),
        "sample_time_s": sample_time,
        "heldout_sequences": len(heldout),
        "train_config": None if args.epochs == 0 else asdict(cfg),
        **{k: v for k, v in metrics.items() if k != "train_loss"},
        "train_loss_every_10": metrics.get("train_loss", [])[::10],
        "init_heads": args.init_heads,
        "init_summary": init_summary,
    }
    summary_path = out.with_suffix(".json")
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"saved heads to {out} and summary to {summary_path}")
    return summary


if __name__ == "__main__":
    main()
