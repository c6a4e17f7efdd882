"""The head-consolidation actor: current draft heads (versioned), drift telemetry, the slow path.

Rollout actors send it one `DriftRecord` per step without waiting. It holds the heads every
rollout actor should draft with, and a new version reaches all of them through one object in
the object store. With a slow-path adaptation (`rollout.speculation.adaptation` slow, both or
every_step) the driver hands it each step's head telemetry and matured records
(`consolidate`), which it gives to a `HeadConsolidator` (speculation/adaptation/consolidation.py): drift
detection and, when triggered, a head-only update on the current policy's frozen LM head and
embeddings, broadcast as a new head version when held-out records confirm it. The driver calls
`consolidate` before the learner's update and collects its report after, so the update
overlaps training.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import ray
import torch

from specroll.models.flat_weights import FlatWeights
from specroll.rollout.stats import TreeStats
from specroll.speculation import HorizonHeads, SpeculationConfig
from specroll.speculation.adaptation.consolidation import HeadConsolidator
from specroll.speculation.adaptation.drift import HeadTelemetry, merge_telemetry
from specroll.speculation.adaptation.replay import MaturedRecords, cat_records
from specroll.telemetry import metric_names as m

from .placement import actor_device
from .remote_calls import gather

HISTORY_SIZE = 4096  # drift records kept; ~100 bytes each


@dataclass(frozen=True)
class DriftRecord:
    """How one rollout actor's draft heads fared in one step: a few numbers, sent every step."""

    actor_index: int
    step: int
    policy_version: int
    head_version: int
    verify_steps: int
    tokens_per_step: float  # tokens emitted per response per verify pass
    acceptance_by_depth: tuple[float, ...]  # accepted share of drafts that reached each tree depth
    budget_mean: float  # tree nodes per response (root included) over verify passes; 0 without any
    budget_min: int
    budget_max: int

    @classmethod
    def from_stats(cls, stats: TreeStats, actor_index: int, step: int, policy_version: int,
                   head_version: int) -> "DriftRecord":
        """From the tree stats of one speculative `RolloutEngine.generate`."""
        budgets = stats.budget_per_step
        return cls(
            actor_index=actor_index,
            step=step,
            policy_version=policy_version,
            head_version=head_version,
            verify_steps=int(stats.verify_steps),
            tokens_per_step=float(stats.tokens_per_step_mean),
            acceptance_by_depth=tuple(float(a) for a in stats.acceptance_by_depth),
            budget_mean=sum(budgets) / len(budgets) if budgets else 0.0,
            budget_min=min(budgets, default=0),
            budget_max=max(budgets, default=0),
        )


@dataclass(frozen=True)
class ConsolidationReport:
    """What the slow path did with one step's telemetry."""

    step: int
    heads_asked: tuple[int, ...]  # heads the detector (or the every_step schedule) named
    committed: bool  # an update was kept and broadcast
    update_s: float  # seconds spent updating heads (0 without an update)
    loss: float | None  # training loss of the update's last step
    drift_z_max: float | None  # largest robust z at this step's check (None: no check)


class HeadConsolidationActor:
    """Holds `(version, head weights)`, keeps the latest drift records, pushes heads to rollout
    actors, and runs the slow path when the run's adaptation has one.

    Rollout actors never wait on this actor (they send telemetry without waiting for an
    answer), so its waiting on them for a broadcast cannot deadlock.
    """

    def __init__(self, timeout_s: float, spec: SpeculationConfig | None = None, history_size: int = HISTORY_SIZE) -> None:
        self.timeout_s = timeout_s
        self.spec = spec if spec is not None and spec.uses_slow_path else None
        self.records: deque[DriftRecord] = deque(maxlen=history_size)
        self.version: int | None = None
        self.state: dict[str, torch.Tensor] | None = None
        self.meta: dict | None = None
        self.consolidator: HeadConsolidator | None = None
        self.policy: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (version, LM head, embeddings)
        self.rollout_actors: list = []
        self.sync_s = 0.0  # broadcast time not yet reported by `step_metrics`
        self.update_s = 0.0  # update time not yet reported
        self.updates = 0  # updates run since the run began
        self.report: ConsolidationReport | None = None

    def attach(self, rollout_actors: list) -> None:
        """The rollout actors that receive every head version from now on."""
        self.rollout_actors = list(rollout_actors)

    def record(self, record: DriftRecord) -> None:
        self.records.append(record)

    def drift_history(self) -> list[DriftRecord]:
        """The kept drift records, oldest first."""
        return list(self.records)

    def set_heads(self, heads: Mapping) -> int:
        """Adopt `{"version", "state", "meta"[, "consolidation"]}` as they are (the run's initial
        heads, or a checkpoint's, with the slow path's state) and broadcast them. Returns the version."""
        self.version = int(heads["version"])
        self.state = {k: v.detach().to("cpu", copy=True) for k, v in heads["state"].items()}
        self.meta = dict(heads.get("meta") or self.meta or {})
        if self.spec is not None:
            built = HorizonHeads.from_state({**self.meta, "version": self.version}, self.state)
            self.consolidator = HeadConsolidator(built, self.spec.adaptation, self.speculation.adaptation.drift, self.speculation.adaptation.consolidation)
            if heads.get("consolidation") is not None:
                self.consolidator.load_state_dict(heads["consolidation"])
        self.broadcast()
        return self.version

    def publish_heads(self, state: Mapping[str, torch.Tensor]) -> int:
        """New head weights: the version goes up by one and every rollout actor receives them
        (between two of its generate calls). Returns the new version."""
        if self.state is None:
            raise ValueError("no heads yet: set_heads must give the initial heads before a publish")
        if set(state) != set(self.state):
            raise ValueError(f"published heads have keys {sorted(state)}, expected {sorted(self.state)}")
        return self.set_heads({"version": self.version + 1, "state": state,
                               "consolidation": None if self.consolidator is None else self.consolidator.state_dict()})

    def heads(self) -> dict | None:
        """`{"version", "state", "meta", "consolidation"}` of the current heads and the slow path's
        state (what a checkpoint stores), or None."""
        if self.state is None:
            return None
        return {"version": self.version, "state": self.state, "meta": self.meta,
                "consolidation": None if self.consolidator is None else self.consolidator.state_dict()}

    def load_policy(self, version: int, weights: FlatWeights) -> int:
        """The learner's policy `version`: the slow path trains heads against its LM head and embeddings."""
        device = actor_device("auto")  # the GPU Ray reserved for this actor, if any
        state = weights.tensors()
        embed_view = state["embed_tokens.weight"]
        lm_head_view = state.get("lm_head.weight", embed_view)
        # Copied: a view would pin the whole policy's object in the store until the next version.
        embed = embed_view.to(device, copy=True)
        lm_head = embed if lm_head_view.data_ptr() == embed_view.data_ptr() else lm_head_view.to(device, copy=True)
        self.policy = (version, lm_head, embed)
        return version

    def consolidate(self, step: int, parts: list[tuple[HeadTelemetry, MaturedRecords | None]]) -> ConsolidationReport:
        """One step's telemetry and records from every rollout actor: drift check, and an update
        of the named heads when one is due; a kept update is broadcast before this returns."""
        if self.consolidator is None or self.policy is None:
            raise ValueError("consolidate needs rollout.speculation.adaptation with a slow path, initial heads and a policy")
        version, lm_head, embed = self.policy
        telemetry = merge_telemetry([t for t, _ in parts])
        kept = [r for _, r in parts if r is not None and len(r)]
        asked = self.consolidator.observe(telemetry, cat_records(kept) if kept else None, version)
        check = self.consolidator.last_check
        result = self.consolidator.update(asked, lm_head, embed, seed=step) if asked else None
        if result is not None:
            self.updates += 1
            self.update_s += result.seconds
            if result.committed:
                state = {k: v.detach().to("cpu", copy=True) for k, v in self.consolidator.heads.state_dict().items()}
                self.version, self.state = result.version, state
                self.broadcast()
        self.report = ConsolidationReport(step, tuple(asked), bool(result and result.committed),
                                          result.seconds if result else 0.0, result.loss if result else None,
                                          None if check is None else check.z_max)
        return self.report

    def broadcast(self) -> None:
        started = time.perf_counter()
        shared = ray.put(self.state)  # one object; every rollout actor reads the same one
        calls = [(f"rollout actor {i}", actor.set_heads.remote(self.version, shared))
                 for i, actor in enumerate(self.rollout_actors)]
        gather(calls, f"set_heads (head version {self.version})", self.timeout_s)
        self.sync_s += time.perf_counter() - started

    def step_metrics(self) -> dict[str, float]:
        """heads/* and the broadcast time since the previous call (timing_s/head_sync)."""
        metrics = {m.TIME_HEAD_SYNC: self.sync_s}
        if self.version is not None:
            metrics[m.HEADS_VERSION] = float(self.version)
        if self.consolidator is not None:
            replay, detector = self.consolidator.replay, self.consolidator.detector
            metrics.update({m.HEADS_UPDATES: float(self.updates), m.HEADS_UPDATE_S: self.update_s,
                            m.HEADS_REPLAY_RECORDS: float(len(replay)), m.HEADS_REPLAY_DROPPED: float(replay.dropped),
                            m.HEADS_DRIFT_TRIGGERS: float(detector.triggers)})
            if self.report is not None and self.report.loss is not None:
                metrics[m.HEADS_LOSS] = self.report.loss
            if self.report is not None and self.report.drift_z_max is not None:
                metrics[m.HEADS_DRIFT_Z_MAX] = self.report.drift_z_max
        self.sync_s = self.update_s = 0.0
        self.report = None
        return metrics
