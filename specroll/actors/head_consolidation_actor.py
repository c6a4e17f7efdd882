"""The head-consolidation actor: current draft heads (versioned) and the slow path.

It holds the heads every rollout actor should draft with, and a new version reaches all of them
through one object in the object store. With a slow-path adaptation (`rollout.speculation.adaptation`
slow, both or every_step) the driver hands it each step's drift telemetry and matured records
from every rollout actor (`consolidate`), which it gives to a `HeadConsolidator`
(speculation/adaptation/consolidation.py): drift detection and, when triggered, a head-only update on the current policy's frozen LM head and
embeddings, broadcast as a new head version when held-out records confirm it. The driver calls
`consolidate` before the learner's update and collects its report after, so the update
overlaps training.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

import ray
import torch

from specroll.models.flat_weights import FlatWeights, view
from specroll.models.weight_buckets import Bucket, BucketPlan
from specroll.run_dir import SeesRunDir
from specroll.speculation import HorizonHeads, SpeculationConfig
from specroll.speculation.adaptation.consolidation import HeadConsolidator
from specroll.speculation.adaptation.drift_detector import merge_telemetry
from specroll.speculation.adaptation.head_records import HeadRecords
from specroll.speculation.adaptation.replay import cat_records
from specroll.speculation.drafting.heads_state import HeadsState
from specroll.telemetry import metric_names as m

from .placement import actor_device
from .remote_calls import gather
from .rendezvous import MasterAddress
from .sync_group import MemberDevice, SyncGroup, member_device

@dataclass(frozen=True)
class ConsolidationReport:
    """What the slow path did with one step's telemetry."""

    step: int
    heads_asked: tuple[int, ...]  # heads the detector (or the every_step schedule) named
    committed: bool  # an update was kept and broadcast
    update_s: float  # seconds spent updating heads (0 without an update)
    loss: float | None  # training loss of the update's last step
    drift_z_max: float | None  # largest robust z at this step's check (None: no check)


@dataclass(frozen=True)
class SlowPathStats:
    """The slow path's counters when the driver asks for them."""

    updates: int  # head updates run since the actor started
    update_s: float  # seconds spent updating heads since the previous ask
    replay_records: int  # matured records in the replay memory
    replay_dropped: int  # records the replay memory's cap has evicted since the start of the run
    drift_triggers: int  # drift events since the start of the run
    loss: float | None  # training loss of this step's update; None without one
    drift_z_max: float | None  # largest robust z at this step's drift check; None without a check


@dataclass(frozen=True)
class HeadsStepStats:
    """What the head-consolidation actor did since the driver last asked: its heads/* metrics."""

    head_sync_s: float  # seconds spent broadcasting heads to the rollout actors
    version: int | None  # of the heads every rollout actor drafts with; None before the initial heads
    slow_path: SlowPathStats | None  # None without a slow-path adaptation

    def metrics(self) -> dict[str, float]:
        """timing_s/head_sync, heads/version and the slow path's heads/*."""
        metrics = {m.TIME_HEAD_SYNC: self.head_sync_s}
        if self.version is not None:
            metrics[m.HEADS_VERSION] = float(self.version)
        slow = self.slow_path
        if slow is not None:
            metrics.update({m.HEADS_UPDATES: float(slow.updates), m.HEADS_UPDATE_S: slow.update_s,
                            m.HEADS_REPLAY_RECORDS: float(slow.replay_records),
                            m.HEADS_REPLAY_DROPPED: float(slow.replay_dropped),
                            m.HEADS_DRIFT_TRIGGERS: float(slow.drift_triggers)})
            if slow.loss is not None:
                metrics[m.HEADS_LOSS] = slow.loss
            if slow.drift_z_max is not None:
                metrics[m.HEADS_DRIFT_Z_MAX] = slow.drift_z_max
        return metrics


class HeadConsolidationActor(SeesRunDir):
    """Holds the current `HeadsState`, pushes heads to rollout actors, and runs the slow path on
    the head records the driver hands it (`consolidate`) when the run's adaptation has one.

    Rollout actors never call this actor, so its waiting on them for a broadcast cannot deadlock.
    """

    def __init__(self, timeout_s: float, spec: SpeculationConfig | None = None) -> None:
        self.timeout_s = timeout_s
        self.spec = spec if spec is not None and spec.uses_slow_path else None
        self.current: HeadsState | None = None  # what every rollout actor drafts with; no slow-path state
        self.consolidator: HeadConsolidator | None = None
        self.policy: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (version, LM head, embeddings)
        self.sync: SyncGroup | None = None  # its end of the weight-sync group (weight_sync=collective)
        self.rollout_actors: list = []
        self.sync_s = 0.0  # broadcast time not yet reported by `step_stats`
        self.update_s = 0.0  # update time not yet reported
        self.updates = 0  # updates run since the run began
        self.report: ConsolidationReport | None = None

    def attach(self, rollout_actors: list) -> None:
        """The rollout actors that receive every head version from now on."""
        self.rollout_actors = list(rollout_actors)

    def set_heads(self, heads: HeadsState) -> int:
        """Adopt `heads` as they are (the run's initial heads, or a checkpoint's with the slow path's
        state) and broadcast them; heads without meta keep the current meta. Returns their version."""
        meta = heads.meta
        if meta is None and self.current is not None:
            meta = self.current.meta
        state = {k: v.detach().to("cpu", copy=True) for k, v in heads.state.items()}
        self.current = HeadsState(heads.version, state, meta)
        if self.spec is not None:
            self.consolidator = self.build_consolidator(heads.consolidation)
        self.broadcast()
        return self.current.version

    def build_consolidator(self, saved: dict | None) -> HeadConsolidator:
        """The slow path over the current heads, resuming from its `saved` state when given."""
        current = self.current
        if current.meta is None:
            raise ValueError("the slow path needs the heads' meta (type, sizes, base model); these heads came without")
        built = HorizonHeads.from_state(asdict(replace(current.meta, version=current.version)), current.state)
        consolidator = HeadConsolidator(built, self.spec.adaptation, self.spec.drift, self.spec.consolidation)
        if saved is not None:
            consolidator.load_state_dict(saved)
        return consolidator

    def publish_heads(self, state: Mapping[str, torch.Tensor]) -> int:
        """New head weights: the version goes up by one and every rollout actor receives them
        (between two of its generate calls). Returns the new version."""
        current = self.current
        if current is None:
            raise ValueError("no heads yet: set_heads must give the initial heads before a publish")
        if set(state) != set(current.state):
            raise ValueError(f"published heads have keys {sorted(state)}, expected {sorted(current.state)}")
        return self.set_heads(HeadsState(current.version + 1, dict(state), current.meta, self.consolidator_state()))

    def heads(self) -> HeadsState | None:
        """The current heads with the slow path's state (what a checkpoint stores); None before the initial heads."""
        return None if self.current is None else replace(self.current, consolidation=self.consolidator_state())

    def consolidator_state(self) -> dict | None:
        return None if self.consolidator is None else self.consolidator.state_dict()

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

    def weight_sync_device(self) -> MemberDevice:
        return member_device(torch.device(actor_device("auto")))

    def join_weight_sync(self, address: MasterAddress, rank: int, size: int, backend: str, plan: BucketPlan,
                         timeout_s: float) -> None:
        self.sync = SyncGroup.join(address, rank, size, backend, plan, timeout_s)

    def receive_policy(self, version: int) -> int:
        """The learner's policy `version` streamed over the weight-sync group: every bucket passes
        through, the LM head and embeddings are kept, and replace the last ones once the version checks."""
        device = actor_device("auto")
        kept: dict[str, torch.Tensor] = {}

        def keep(bucket: Bucket, flat: torch.Tensor) -> None:
            for slot in bucket.slots:
                wanted = [name for name in slot.names if name in ("embed_tokens.weight", "lm_head.weight")]
                if wanted:  # copied: the bucket's buffer is reused; tied names keep one tensor
                    kept.update(dict.fromkeys(wanted, view(flat, slot).to(device, copy=True)))

        self.sync.receive(version, keep)
        embed = kept["embed_tokens.weight"]
        self.policy = (version, kept.get("lm_head.weight", embed), embed)
        return version

    def consolidate(self, step: int, parts: list[HeadRecords]) -> ConsolidationReport:
        """One step's telemetry and records from every rollout actor: drift check, and an update
        of the named heads when one is due; a kept update is broadcast before this returns."""
        if self.consolidator is None or self.policy is None:
            raise ValueError("consolidate needs rollout.speculation.adaptation with a slow path, initial heads and a policy")
        version, lm_head, embed = self.policy
        telemetry = merge_telemetry([part.telemetry for part in parts])
        kept = [part.matured for part in parts if part.matured is not None and len(part.matured)]
        asked = self.consolidator.observe(telemetry, cat_records(kept) if kept else None, version)
        check = self.consolidator.last_check
        result = self.consolidator.update(asked, lm_head, embed, seed=step) if asked else None
        if result is not None:
            self.updates += 1
            self.update_s += result.seconds
            if result.committed:
                state = {k: v.detach().to("cpu", copy=True) for k, v in self.consolidator.heads.state_dict().items()}
                self.current = HeadsState(result.version, state, self.current.meta)
                self.broadcast()
        self.report = ConsolidationReport(step, tuple(asked), bool(result and result.committed),
                                          result.seconds if result else 0.0, result.loss if result else None,
                                          None if check is None else check.z_max)
        return self.report

    def broadcast(self) -> None:
        started = time.perf_counter()
        shared = ray.put(self.current)  # one object; every rollout actor reads the same one
        calls = [(f"rollout actor {i}", actor.set_heads.remote(shared)) for i, actor in enumerate(self.rollout_actors)]
        gather(calls, f"set_heads (head version {self.current.version})", self.timeout_s)
        self.sync_s += time.perf_counter() - started

    def step_stats(self) -> HeadsStepStats:
        """The broadcast time and the slow path's counters since the previous call."""
        slow, report = None, self.report
        if self.consolidator is not None:
            replay = self.consolidator.replay
            slow = SlowPathStats(self.updates, self.update_s, len(replay), replay.dropped,
                                 self.consolidator.detector.triggers, None if report is None else report.loss,
                                 None if report is None else report.drift_z_max)
        stats = HeadsStepStats(self.sync_s, None if self.current is None else self.current.version, slow)
        self.sync_s = self.update_s = 0.0
        self.report = None
        return stats
