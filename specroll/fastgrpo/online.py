"""Online draft learning (FastGRPO): after every step, the drafter trains on that step's responses.

The rollout actor runs it right after generating, on the features its verify passes logged,
so the step pays for it (as in FastGRPO, where drafter training is part of the rollout phase).
A float32 master copy trains with AdamW; the drafting copy (the policy's dtype) takes its
weights after each update. Saved and restored with the run's checkpoints (`state_dict`).
"""
from __future__ import annotations

import copy
import time
from dataclasses import asdict
from typing import NamedTuple

import torch

from .config import OnlineConfig
from .drafter import DrafterMeta, FeatureDrafter, check_fits
from .feature_log import DraftSequences
from .loss import draft_loss


class DrafterUpdate(NamedTuple):
    """One online update of a rollout actor's drafter."""

    seconds: float
    loss: float  # mean training loss of the update's optimiser steps, each taken before its step
    entries: int  # training entries (response tokens with a next feature)
    updates: int  # updates of this drafter since pretraining, this one included


def token_batches(data: DraftSequences, batch_tokens: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Shuffled rows of `data` grouped into batches of about `batch_tokens` entries (at least one row each)."""
    order = torch.randperm(len(data), generator=generator).tolist()
    entries = (data.lengths - 1).clamp(min=0).tolist()
    batches, current, count = [], [], 0
    for row in order:
        current.append(row)
        count += entries[row]
        if count >= batch_tokens:
            batches.append(torch.tensor(current))
            current, count = [], 0
    if current:
        batches.append(torch.tensor(current))
    return batches


class OnlineDrafterLearner:
    def __init__(self, drafter: FeatureDrafter, model, cfg: OnlineConfig, seed: int = 0) -> None:
        self.drafter, self.model, self.cfg = drafter, model, cfg
        self.master = copy.deepcopy(drafter).float().use_prepacked_linears(False).train()
        self.optimizer = torch.optim.AdamW(self.master.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def updates(self) -> int:
        return self.master.updates

    def loss(self, data: DraftSequences) -> float:
        """The draft loss of the current drafter on `data`, no update."""
        lm_head, embed, data = self.policy_weights(data)
        with torch.no_grad():
            return float(draft_loss(self.master, data, lm_head, embed, self.cfg.feature_weight, self.cfg.ce_weight,
                                    self.cfg.chunk_tokens).total)

    def policy_weights(self, data: DraftSequences):
        """The policy's LM head and embeddings, and `data`, in float32 on the master's device."""
        device = self.master.fc.weight.device
        lm_head = self.model.lm_head.weight.detach().to(device, torch.float32)
        embed = self.model.embed_tokens.weight.detach().to(device, torch.float32)
        return lm_head, embed, data.to(device, torch.float32)

    def update(self, data: DraftSequences) -> DrafterUpdate:
        """`cfg.epochs` passes over `data`, then the drafting copy takes the new weights."""
        started = time.perf_counter()
        cfg = self.cfg
        lm_head, embed, data = self.policy_weights(data)
        losses = []
        with torch.inference_mode(False), torch.enable_grad():
            for _ in range(cfg.epochs):
                for rows in token_batches(data, cfg.batch_tokens, self.generator):
                    loss = draft_loss(self.master, data.select(rows.to(data.tokens.device)), lm_head, embed,
                                      cfg.feature_weight, cfg.ce_weight, cfg.chunk_tokens)
                    self.optimizer.zero_grad(set_to_none=True)
                    loss.total.backward()
                    torch.nn.utils.clip_grad_norm_(self.master.parameters(), cfg.max_grad_norm)
                    self.optimizer.step()
                    losses.append(float(loss.total.detach()))
        self.master.updates += 1
        self.publish()
        return DrafterUpdate(time.perf_counter() - started, sum(losses) / len(losses), data.num_entries,
                             self.master.updates)

    def publish(self) -> None:
        """The drafting copy takes the master's weights (cast to its dtype, in place)."""
        with torch.no_grad():
            self.drafter.load_state_dict(self.master.state_dict())
        self.drafter.updates = self.master.updates

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Master weights, meta and optimiser state on the CPU (loads with `weights_only=True`)."""
        cpu = lambda x: x.detach().to("cpu", copy=True) if torch.is_tensor(x) else x  # noqa: E731
        optimizer = self.optimizer.state_dict()
        return {"meta": asdict(self.master.meta()),
                "drafter": {k: cpu(v) for k, v in self.master.state_dict().items()},
                "optimizer": {"state": {k: {n: cpu(t) for n, t in s.items()} for k, s in optimizer["state"].items()},
                              "param_groups": optimizer["param_groups"]}}

    def load_state_dict(self, state: dict) -> None:
        check_fits(DrafterMeta(**state["meta"]), self.model, "the checkpointed drafter")
        self.master.load_state_dict(state["drafter"])
        self.master.updates = int(state["meta"]["updates"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.publish()
