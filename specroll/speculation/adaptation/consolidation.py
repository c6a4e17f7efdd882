"""The slow path: drift-triggered, head-only updates from replayed records (docs/algorithm.md, section 6).

Rollout actors send each step's head telemetry and a sample of matured records. The
consolidator keeps the records (bounded, older policy versions aged out), runs the drift
detector on the telemetry, and when it names degraded heads (or after every step, in
`every_step` mode) trains those heads alone for a few steps on the shared head loss with a
proximal term toward the heads that drafted, over their draft vocabulary as in pretraining. The
policy (backbone, embeddings, LM head) stays frozen. Each trained head is kept only if its own
held-out records say it helped (cross-entropy not above `commit_ce_ratio` x before, TV lower, and
the policy's probability of the head's first guess not lower: fit alone let deep heads'
acceptance fall); otherwise that head's parameters and optimiser state go back. (Judged over all
heads' records together, head 0's many records hid deeper heads that an update made worse.)
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace

import torch

from ..drafting.heads import HorizonHeads
from ..head_training.loss import HeadBatch, HeadLossConfig, head_states, train_step
from ..head_training.targets import SparseDistribution
from .drift_detector import DriftCheck, DriftConfig, DriftDetector, HeadTelemetry
from .replay import MaturedRecords, ReplayMemory


@dataclass
class ConsolidationConfig:
    """Head-only updates (mirrored by `rollout.speculation.consolidation` in conf/rollout/speculation.yaml)."""

    replay_capacity: int = 32768  # records kept for updates, newest first
    max_policy_lag: int = 2  # records sampled by a policy this many versions older than the newest age out
    held_out_fraction: float = 0.1  # records kept apart to judge an update
    # The design's lr 1e-5 x 2 steps left drifted heads where they were (docs/history/2026-12-02.md).
    lr: float = 3e-4  # AdamW learning rate of the heads
    steps: int = 30  # optimiser steps per update
    batch_records: int = 512  # training records per optimiser step, a fresh random sample (all when fewer)
    max_grad_norm: float = 1.0  # gradient clipping
    distill_weight: float = 0.7  # weight of KL(p || q) to the policy's top-32 + tail
    nll_weight: float = 0.3  # weight of the realised token's NLL
    proximal_weight: float = 0.1  # weight of KL(q_old || q) toward the heads that drafted
    head_decay: float = 0.8  # per-head weight decay^(k-1)
    commit_ce_ratio: float = 1.01  # keep a head only if held-out CE <= this x before (TV lower, first guess no lower)
    wait: bool = False  # the driver waits for an update before the next rollout (else it overlaps the learner)

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"speculation.consolidation.{name} must be {rule}, got {getattr(self, name)!r}")

        check(self.replay_capacity >= 1, "replay_capacity", ">= 1")
        check(self.max_policy_lag >= 0, "max_policy_lag", ">= 0")
        check(0 < self.held_out_fraction < 1, "held_out_fraction", "in (0, 1)")
        check(self.lr > 0, "lr", "> 0")
        check(self.steps >= 1, "steps", ">= 1")
        check(self.batch_records >= 1, "batch_records", ">= 1")
        check(self.max_grad_norm > 0, "max_grad_norm", "> 0")
        for name in ("distill_weight", "nll_weight", "proximal_weight"):
            check(getattr(self, name) >= 0, name, ">= 0")
        check(0 < self.head_decay <= 1, "head_decay", "in (0, 1]")
        check(self.commit_ce_ratio >= 1, "commit_ce_ratio", ">= 1")

    @property
    def loss(self) -> HeadLossConfig:
        return HeadLossConfig(self.distill_weight, self.nll_weight, self.proximal_weight, self.head_decay)


@dataclass(frozen=True)
class UpdateResult:
    """One head-only update."""

    heads: tuple[int, ...]  # heads trained (0-based)
    kept: tuple[int, ...]  # of those, the heads whose update was kept (the others rolled back)
    version: int  # head version after it
    train_records: int
    step_records: int  # records each optimiser step used (bounds the update's cost)
    held_out_records: int
    ce_before: float  # held-out cross-entropy to the policy's (coarsened) distribution, trained heads' records
    ce_after: float  # the same after training, before any head is rolled back
    tv_before: float  # held-out TV between head and policy (coarsened)
    tv_after: float
    loss: float  # training loss of the last optimiser step
    seconds: float

    @property
    def committed(self) -> bool:
        """Some head's update was kept: a new head version."""
        return bool(self.kept)


def records_batch(records: MaturedRecords, num_heads: int, embed: torch.Tensor, device,
                  draft_vocab: torch.Tensor | None = None) -> HeadBatch:
    """The records as a `HeadBatch`: record i gives head `records.head[i]` its target, no other.
    With a draft vocabulary the ids become rows of the draft LM head (`HorizonHeads.draft_lm_head`),
    and a token outside it becomes -1 (no NLL term), as in head pretraining."""
    n, head = len(records), records.head.long().to(device)
    row_of = None
    if draft_vocab is not None:
        row_of = torch.full((embed.shape[0],), -1, dtype=torch.long, device=device)  # token id -> draft LM-head row
        row_of[draft_vocab.to(device)] = torch.arange(draft_vocab.numel(), device=device)

    def rows_of(ids: torch.Tensor) -> torch.Tensor:
        ids = ids.long().to(device)
        return ids if row_of is None else torch.where(ids >= 0, row_of[ids.clamp(min=0)], -1)

    target_ids = rows_of(records.target_ids)
    if (target_ids < 0).any():
        raise ValueError("records hold target tokens outside the heads' draft vocabulary: they were not "
                         "recorded by a decoder drafting with these heads")
    rows = torch.arange(n, device=device)
    valid = torch.zeros(n, num_heads, dtype=torch.bool, device=device)
    valid[rows, head] = True

    def at_head(x: torch.Tensor) -> torch.Tensor:  # [n, ...] -> [n, H, ...], placed at each record's head
        out = torch.zeros(n, num_heads, *x.shape[1:], dtype=x.dtype, device=device)
        out[rows, head] = x.to(device)
        return out

    proximal = SparseDistribution(at_head(records.proposal_logp.float()), at_head(rows_of(records.proposal_ids)),
                                  at_head(records.proposal_tail.float()))
    return HeadBatch(records.hidden.to(device).float(), embed[records.path_tokens.long().to(device)], valid,
                     at_head(records.target_logp.float()), at_head(target_ids),
                     at_head(records.target_tail.float()), at_head(rows_of(records.token)), proximal)


@dataclass(frozen=True)
class HeadFit:
    """Sums over one head's held-out records of its cross-entropy and TV to the policy, and of
    the policy's probability of the head's first guess (a one-child draft's acceptance)."""

    ce_sum: float
    tv_sum: float
    first_guess_sum: float
    records: int

    @property
    def ce(self) -> float:
        return self.ce_sum / max(self.records, 1)

    @property
    def tv(self) -> float:
        return self.tv_sum / max(self.records, 1)

    @property
    def first_guess(self) -> float:
        return self.first_guess_sum / max(self.records, 1)


@torch.no_grad()
def held_out_fit(heads: HorizonHeads, lm_head: torch.Tensor, batch: HeadBatch, chunk: int = 512) -> list[HeadFit]:
    """Per head: cross-entropy and TV of the head against the policy over its records in the
    batch, coarsened to each target's top tokens + one tail bucket. `lm_head`: the rows the
    batch's ids index (the draft LM head, see `records_batch`)."""
    states = head_states(heads, batch)
    fits = []
    for j in range(heads.num_heads):
        ce_sum, tv_sum, first_guess_sum = 0.0, 0.0, 0.0
        rows = batch.valid[:, j].nonzero()[:, 0]
        for c in range(0, rows.numel(), chunk):
            r = rows[c : c + chunk]
            logq = torch.log_softmax(torch.nn.functional.linear(states[r, j], lm_head).float(), dim=-1)
            logq_top = logq.gather(1, batch.top_idx[r, j])
            q_tail = (1 - logq_top.exp().sum(1)).clamp(min=1e-12)
            p_top, p_tail = batch.top_logp[r, j].exp(), batch.tail_logp[r, j].exp()
            ce_sum += float(-(p_top * logq_top).sum() - (p_tail * q_tail.log()).sum())
            tv_sum += float(0.5 * ((p_top - logq_top.exp()).abs().sum(1) + (p_tail - q_tail).abs()).sum())
            guess = logq.argmax(dim=1, keepdim=True)  # outside p's top tokens it counts 0: a lower bound
            first_guess_sum += float((p_top * (batch.top_idx[r, j] == guess)).sum())
        fits.append(HeadFit(ce_sum, tv_sum, first_guess_sum, rows.numel()))
    return fits


def pooled(fits: list[HeadFit]) -> HeadFit:
    """The fits of several heads as one, weighted by their records."""
    return HeadFit(sum(f.ce_sum for f in fits), sum(f.tv_sum for f in fits), sum(f.first_guess_sum for f in fits),
                   sum(f.records for f in fits))


class HeadConsolidator:
    """Replay, drift detection and head-only updates; plain Python, wrapped by the actor."""

    def __init__(self, heads: HorizonHeads, adaptation: str, drift: DriftConfig, cfg: ConsolidationConfig) -> None:
        self.heads = copy.deepcopy(heads).float().use_prepacked_linears(False)
        self.adaptation, self.cfg = adaptation, cfg
        self.replay = ReplayMemory(cfg.replay_capacity)
        self.detector = DriftDetector(drift, heads.num_heads)
        self.optimizer = torch.optim.AdamW(self.heads.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.updates: list[UpdateResult] = []
        self.last_check: DriftCheck | None = None  # the detector's latest check (None on steps without one)

    @property
    def version(self) -> int:
        return self.heads.version

    def observe(self, telemetry: HeadTelemetry, records: MaturedRecords | None, policy_version: int) -> list[int]:
        """One training step's telemetry (all actors merged) and records; returns the heads to update now."""
        if records is not None and len(records):
            # Stamped with the policy whose verify passes scored them.
            self.replay.add(replace(records, policy_version=torch.full_like(records.policy_version, policy_version)))
        self.replay.drop_policy_versions_before(policy_version - self.cfg.max_policy_lag)
        self.last_check = self.detector.observe(telemetry)
        if self.adaptation == "every_step":
            return list(range(self.heads.num_heads))
        if self.last_check is not None and self.last_check.event is not None:
            return list(self.last_check.event.heads)
        return []

    def update(self, heads_to_train: list[int], lm_head: torch.Tensor, embed: torch.Tensor,
               seed: int = 0) -> UpdateResult | None:
        """Train `heads_to_train` on the replayed records of the current policy (its `lm_head`,
        `embed`, frozen); keep each trained head only if its held-out records improve. None: no
        records to train those heads on, or none held out. `seed` draws the training batches; the
        held-out responses stay the same across updates, so no update is judged on records an
        earlier one trained on."""
        started = time.perf_counter()
        if len(self.replay) == 0:
            return None
        train, held_out = self.replay.split(self.cfg.held_out_fraction)
        trained = set(heads_to_train) & set(train.head.tolist())  # a head without records has nothing to learn
        if not trained or len(held_out) == 0:
            return None
        device = lm_head.device
        self.heads.to(device)
        # The heads learn what drafting uses: q over the draft vocabulary, as in pretraining.
        lm_head, embed = self.heads.draft_lm_head(lm_head.detach().float()), embed.detach().float()
        vocab = self.heads.draft_vocab
        train_batch = records_batch(train, self.heads.num_heads, embed, device, vocab)
        held_batch = records_batch(held_out, self.heads.num_heads, embed, device, vocab)
        before = held_out_fit(self.heads, lm_head, held_batch)
        saved = {p: (p.detach().clone(), copy.deepcopy(self.optimizer.state.get(p)))
                 for k in trained for p in self.head_parameters(k)}
        step_records = min(self.cfg.batch_records, len(train))
        sampler = torch.Generator().manual_seed(seed)
        self.heads.train()
        for _ in range(self.cfg.steps):
            self.optimizer.zero_grad(set_to_none=True)
            rows = torch.randperm(len(train), generator=sampler)[:step_records].to(device)
            loss = train_step(self.heads, lm_head, train_batch.rows(rows), self.cfg.loss)
            for k in range(self.heads.num_heads):
                if k not in trained:  # a parameter without a gradient is left alone by AdamW
                    for p in self.head_parameters(k):
                        p.grad = None
            torch.nn.utils.clip_grad_norm_(self.heads.parameters(), self.cfg.max_grad_norm)
            self.optimizer.step()
        self.heads.eval()
        after = held_out_fit(self.heads, lm_head, held_batch)
        kept = tuple(k for k in sorted(trained) if after[k].records and after[k].ce <= self.cfg.commit_ce_ratio
                     * before[k].ce and after[k].tv < before[k].tv and after[k].first_guess >= before[k].first_guess)
        for k in trained - set(kept):
            self.roll_back(k, saved)
        if kept:
            self.heads.version += 1
        fit_before, fit_after = pooled([before[k] for k in trained]), pooled([after[k] for k in trained])
        result = UpdateResult(tuple(sorted(trained)), kept, self.heads.version, len(train), step_records,
                              len(held_out), fit_before.ce, fit_after.ce, fit_before.tv, fit_after.tv, loss,
                              time.perf_counter() - started)
        self.updates.append(result)
        return result

    def head_parameters(self, k: int) -> list[torch.nn.Parameter]:
        return [*self.heads.blocks[k].parameters(), *self.heads.layers[k].parameters()]

    @torch.no_grad()
    def roll_back(self, k: int, saved: dict) -> None:
        """Head k's parameters and their optimiser moments as they were before the update."""
        for p in self.head_parameters(k):
            value, moments = saved[p]
            p.copy_(value)
            if moments is None:
                self.optimizer.state.pop(p, None)
            else:
                self.optimizer.state[p] = moments

    def state_dict(self) -> dict:
        """Detector baselines, replay and optimiser state (the heads themselves are checkpointed apart)."""
        return {"detector": self.detector.state_dict(), "replay": self.replay.state_dict(),
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.detector.load_state_dict(state["detector"])
        self.replay.load_state_dict(state["replay"])
        self.optimizer.load_state_dict(state["optimizer"])
