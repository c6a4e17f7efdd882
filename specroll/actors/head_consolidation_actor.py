"""The head-consolidation actor: current draft heads (versioned), drift telemetry, head broadcast.

Rollout actors send it one `DriftRecord` per step. It holds the heads every rollout actor
should draft with, and a new version reaches all of them through one object in the object
store. The drift-triggered head-only update (the slow path) will run here; until then heads
change only through `publish_heads`.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import ray
import torch

from specroll.telemetry import metric_names as m

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
    def from_stats(cls, stats: Mapping, actor_index: int, step: int, policy_version: int,
                   head_version: int) -> "DriftRecord":
        """From the stats of one speculative `RolloutEngine.generate`."""
        budgets = stats["budget_per_step"]
        return cls(
            actor_index=actor_index,
            step=step,
            policy_version=policy_version,
            head_version=head_version,
            verify_steps=int(stats["verify_steps"]),
            tokens_per_step=float(stats["tokens_per_step_mean"]),
            acceptance_by_depth=tuple(float(a) for a in stats["acceptance_by_depth"]),
            budget_mean=sum(budgets) / len(budgets) if budgets else 0.0,
            budget_min=min(budgets, default=0),
            budget_max=max(budgets, default=0),
        )


class HeadConsolidationActor:
    """Holds `(version, head weights)`, keeps the latest drift records, pushes heads to rollout actors.

    Rollout actors never wait on this actor (they send telemetry without waiting for an
    answer), so its waiting on them for a broadcast cannot deadlock.
    """

    def __init__(self, timeout_s: float, history_size: int = HISTORY_SIZE) -> None:
        self.timeout_s = timeout_s
        self.records: deque[DriftRecord] = deque(maxlen=history_size)
        self.version: int | None = None
        self.state: dict[str, torch.Tensor] | None = None
        self.rollout_actors: list = []
        self.sync_s = 0.0  # broadcast time not yet reported by `step_metrics`

    def attach(self, rollout_actors: list) -> None:
        """The rollout actors that receive every head version from now on."""
        self.rollout_actors = list(rollout_actors)

    def record(self, record: DriftRecord) -> None:
        self.records.append(record)

    def drift_history(self) -> list[DriftRecord]:
        """The kept drift records, oldest first."""
        return list(self.records)

    def set_heads(self, heads: Mapping) -> int:
        """Adopt `{"version", "state"}` as they are (the run's initial heads, or a checkpoint's)
        and broadcast them. Returns the version."""
        self.version = int(heads["version"])
        self.state = {k: v.detach().to("cpu", copy=True) for k, v in heads["state"].items()}
        self.broadcast()
        return self.version

    def publish_heads(self, state: Mapping[str, torch.Tensor]) -> int:
        """New head weights: the version goes up by one and every rollout actor receives them
        (between two of its generate calls). Returns the new version."""
        if self.state is None:
            raise ValueError("no heads yet: set_heads must give the initial heads before a publish")
        if set(state) != set(self.state):
            raise ValueError(f"published heads have keys {sorted(state)}, expected {sorted(self.state)}")
        return self.set_heads({"version": self.version + 1, "state": state})

    def heads(self) -> dict | None:
        """`{"version", "state"}` of the current heads (what a checkpoint stores), or None."""
        return None if self.state is None else {"version": self.version, "state": self.state}

    def broadcast(self) -> None:
        started = time.perf_counter()
        shared = ray.put(self.state)  # one object; every rollout actor reads the same one
        calls = [(f"rollout actor {i}", actor.set_heads.remote(self.version, shared))
                 for i, actor in enumerate(self.rollout_actors)]
        gather(calls, f"set_heads (head version {self.version})", self.timeout_s)
        self.sync_s += time.perf_counter() - started

    def step_metrics(self) -> dict[str, float]:
        """heads/version and the broadcast time since the previous call (timing_s/head_sync)."""
        metrics = {m.TIME_HEAD_SYNC: self.sync_s}
        if self.version is not None:
            metrics[m.HEADS_VERSION] = float(self.version)
        self.sync_s = 0.0
        return metrics
