"""Held-out evaluation of horizon heads against distillation targets, per head: top-1 agreement
with the target's argmax, top-k agreement (target argmax among the head's k best) and the target
mass covered by the head's k best (mass outside the target's top-K counts as zero: a lower bound).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..drafting.heads import HorizonHeads
from .loss import HeadBatch, HeadLossConfig, head_states, sparse_kl_and_nll
from .targets import DistillTargets


@torch.no_grad()
def evaluate(heads: HorizonHeads, lm_head: torch.Tensor, embed: torch.Tensor, targets: DistillTargets,
             loss: HeadLossConfig, positions: int, ks: tuple[int, ...]) -> dict:
    """Per head, on the first `positions` held-out positions: loss terms, agreement with the
    target argmax (top-1 and top-k for k in `ks`), covered mass."""
    n = min(len(targets), positions)
    kmax = max(ks)
    sums = [dict(count=0, kl=0.0, nll=0.0, top1=0.0, **{f"top{k}": 0.0 for k in ks},
                 **{f"mass{k}": 0.0 for k in ks}) for _ in range(heads.num_heads)]
    device = targets.hidden.device
    for c in range(0, n, loss.chunk_positions):
        batch = HeadBatch.from_targets(targets, torch.arange(c, min(c + loss.chunk_positions, n), device=device),
                                       heads.num_heads, embed)
        states = head_states(heads, batch)
        for j in range(heads.num_heads):
            v = batch.valid[:, j]
            if not v.any():
                continue
            top_logp, top_idx, tail_logp, token = batch.head(j)
            z = F.linear(states[v, j], lm_head)
            kl, nll = sparse_kl_and_nll(z, top_logp, top_idx, tail_logp, token)
            # Guesses as drafting makes them: from the draft vocabulary only, if the heads have one.
            vocab = heads.draft_vocab
            guess = (z if vocab is None else z[:, vocab]).topk(kmax, dim=-1).indices  # [m, kmax]
            if vocab is not None:
                guess = vocab[guess]
            hit = guess == top_idx[:, :1]  # target argmax among the head's guesses
            # Target mass on the head's top-k: tokens outside the target's top-K count as 0.
            covered = ((guess[:, :, None] == top_idx[:, None, :]) * top_logp.exp()[:, None, :]).sum(-1)
            s = sums[j]
            s["count"] += int(v.sum())
            s["kl"] += float(kl.sum())
            s["nll"] += float(nll.sum())
            s["top1"] += float(hit[:, 0].sum())
            for k in ks:
                s[f"top{k}"] += float(hit[:, :k].any(-1).sum())
                s[f"mass{k}"] += float(covered[:, :k].sum())
    per_head = [{key: (val / max(s["count"], 1) if key != "count" else val) for key, val in s.items()}
                for s in sums]
    total = sum(loss.head_decay ** j * (loss.distill_weight * h["kl"] + loss.nll_weight * h["nll"])
                for j, h in enumerate(per_head))
    return {"loss": total, "per_head": per_head}


def format_eval(result: dict, ks: tuple[int, ...]) -> str:
    cols = ["top1"] + [f"top{k}" for k in ks] + [f"mass{k}" for k in ks] + ["kl", "nll"]
    lines = ["head  " + "  ".join(f"{c:>6}" for c in cols) + "  positions"]
    for j, h in enumerate(result["per_head"]):
        lines.append(f"{j + 1:>4}  " + "  ".join(f"{h[c]:6.3f}" for c in cols) + f"  {h['count']:>9}")
    lines.append(f"loss {result['loss']:.4f}")
    return "\n".join(lines)
