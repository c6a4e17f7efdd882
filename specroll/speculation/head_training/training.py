"""Head pretraining by self-distillation on the policy's own samples (docs/algorithm.md, section 1).

The frozen policy's samples (`samples`) give distillation targets (`targets`); the heads
learn them with the loss and step shared with the slow path (`loss`) and are evaluated on
held-out prompts (`evaluation`).
Heads with a draft vocabulary (the tokens drafting proposes from) train on it alone: p and
q are both taken over the draft vocabulary, i.e. q learns exactly what drafting uses
(the policy's distribution restricted to those tokens), and a step multiplies a few
thousand LM-head rows instead of SmolLM2's 49k. A sampled token outside the draft
vocabulary gives no NLL term. The command is `python -m specroll.tools.train_heads`.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from specroll.config_checks import check_int, check_number, check_positive, check_probability, check_seed, require

from ..drafting.heads import HorizonHeads
from .evaluation import evaluate, format_eval
from .loss import HeadBatch, HeadLossConfig, train_step
from .samples import SampledSequence
from .targets import DistillTargets, compute_targets


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
            check_int(name, getattr(self, name), 1)
        check_positive("lr", self.lr)
        check_number("weight_decay", self.weight_decay, 0)
        check_number("nll_weight", self.nll_weight, 0)
        check_positive("max_grad_norm", self.max_grad_norm)
        check_probability("head_decay", self.head_decay, low_open=True)
        require(bool(self.eval_ks), "eval_ks", self.eval_ks, "at least one k")
        for i, k in enumerate(self.eval_ks):
            check_int(f"eval_ks[{i}]", k, 1)
        check_seed("seed", self.seed)

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


def training_positions(train: DistillTargets) -> torch.Tensor:
    """[P] the positions where at least head 1 has a target inside the response."""
    positions = (train.remaining >= 1).nonzero()[:, 0]
    if positions.numel() == 0:
        raise ValueError("no training positions: every sampled response is shorter than 2 tokens")
    return positions


def descend(heads: HorizonHeads, lm_head: torch.Tensor, embed: torch.Tensor, train: DistillTargets,
            positions: torch.Tensor, cfg: HeadTrainConfig, evaluate_at: Callable[[int], None],
            progress: bool = True) -> list[float]:
    """`cfg.epochs` shuffled passes of AdamW over `positions` of `train`, the learning rate
    cosine-decayed to zero; `evaluate_at(step)` every `cfg.eval_every` steps but the last.
    `lm_head` [V, D] holds the rows the heads draft from. Returns the loss of each step."""
    steps_per_epoch = math.ceil(positions.numel() / cfg.batch_positions)
    total_steps = cfg.epochs * steps_per_epoch
    optimizer = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / total_steps)))
    generator = torch.Generator().manual_seed(cfg.seed)
    losses, ema = [], None
    bar = tqdm(total=total_steps, desc="heads", unit="step", disable=not progress)
    for _ in range(cfg.epochs):
        perm = torch.randperm(positions.numel(), generator=generator, device=generator.device)
        perm = positions[perm.to(positions.device)]
        for b in range(steps_per_epoch):
            batch = HeadBatch.from_targets(train, perm[b * cfg.batch_positions: (b + 1) * cfg.batch_positions],
                                           heads.num_heads, embed)
            optimizer.zero_grad(set_to_none=True)
            loss = train_step(heads, lm_head, batch, cfg.loss)
            torch.nn.utils.clip_grad_norm_(heads.parameters(), cfg.max_grad_norm)
            optimizer.step()
            schedule.step()
            losses.append(loss)
            ema = loss if ema is None else 0.95 * ema + 0.05 * loss
            bar.update(1)
            bar.set_postfix(loss=f"{ema:.4f}", lr=f"{schedule.get_last_lr()[0]:.2e}")
            if len(losses) % cfg.eval_every == 0 and len(losses) < total_steps:
                evaluate_at(len(losses))
    bar.close()
    return losses


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
    positions = training_positions(train)
    evals = []

    def evaluate_at(step: int) -> None:
        if heldout is None:
            return
        result = evaluate(heads, lm_head, embed, heldout, cfg.loss, cfg.eval_positions, cfg.eval_ks)
        result["step"] = step
        evals.append(result)
        log(f"held-out eval at step {step}:\n{format_eval(result, cfg.eval_ks)}")

    evaluate_at(0)
    losses = descend(heads, train_lm_head, embed, train, positions, cfg, evaluate_at, progress)
    evaluate_at(len(losses))
    heads.to(model_dtype).eval()
    return {
        "train_positions": int(positions.numel()),
        "train_sequences": len(sequences),
        "eval_positions": evals[-1]["per_head"][0]["count"] if evals else 0,
        "steps": len(losses),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "train_loss": losses,
        "eval": evals,
        "wall_time_s": time.perf_counter() - started,
    }
