"""The learner actor: one rank of the DeepSpeed GRPO learner (gloo on CPU, NCCL on GPU).

`cluster.learner_world_size` actors form one data-parallel group. Every method except
`master_address` is collective: the driver calls it on all ranks at once, each with its own
shard of whole groups. Rank 0 hands out the policy weights and writes the checkpoint record.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from specroll.configs import TrainConfig
from specroll.learner import GRPOLearner, GRPOSamples, load_checkpoint, save_checkpoint
from specroll.learner.checkpoint import ResumeState
from specroll.models import resolve_dtype
from specroll.models.flat_weights import FlatWeights
from specroll.models.weight_buckets import BucketPlan
from specroll.run_dir import SeesRunDir
from specroll.speculation.drafting.heads_state import HeadsState

from .batch import Rollouts
from .placement import actor_device, model_cache, use_cpus
from .rendezvous import MasterAddress, rendezvous_point
from .sync_group import MemberDevice, SyncGroup, member_device, rendezvous
from .threads import node_cores, phase_threads, use_threads


@dataclass(frozen=True)
class LearnerUpdate:
    """What one GRPO update hands the driver: a rank's, or all ranks' combined."""

    metrics: dict[str, float]  # train/*, already reduced over ranks
    old_logprob_s: float  # seconds scoring the responses under the current policy (0: taken from the update)
    update_s: float  # seconds of the update itself
    tokens: int  # prompt and response tokens trained on

    @classmethod
    def of_ranks(cls, ranks: list[LearnerUpdate]) -> LearnerUpdate:
        """The step's update: ranks' metrics are equal; a phase lasts as long as its slowest rank."""
        return cls(ranks[0].metrics, max(r.old_logprob_s for r in ranks), max(r.update_s for r in ranks),
                   sum(r.tokens for r in ranks))


class VersionedWeights(NamedTuple):
    """The policy a learner rank hands out; a NamedTuple so that Ray returns its fields as two objects."""

    version: int  # the learner's policy version
    weights: FlatWeights | None  # in the rollout replicas' dtype on rank 0; None on the other ranks


class LearnerActor(SeesRunDir):
    """One learner rank. `setup` joins the process group and builds the `GRPOLearner`."""

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int) -> None:
        use_cpus(cfg.cluster.cpus_per_learner)
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.learner: GRPOLearner | None = None
        self.packed: FlatWeights | None = None  # rank 0: the buffers of the last weights handed out
        self.sync_store = None  # rank 0, weight_sync=collective: the weight-sync group's store
        self.sync: SyncGroup | None = None  # rank 0's end of the weight-sync group, once joined
        self.threads = phase_threads(cfg.cluster, node_cores()).learner  # while training

    def master_address(self) -> MasterAddress:
        """This node's address and a free port of `cluster.master_port_range`, for rank 0 to listen on."""
        return rendezvous_point(self.cfg.cluster.master_port_range)

    def setup(self, master_addr: str, master_port: int) -> int:
        """Join the process group and wrap the initial policy in DeepSpeed; returns the policy version."""
        # Ray gives each GPU actor only its own GPUs, so this rank's device is local index 0.
        os.environ.update(RANK=str(self.rank), LOCAL_RANK="0", WORLD_SIZE=str(self.world_size),
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        device = actor_device(self.cfg.learner.device)
        # Loaded on the CPU in float32: DeepSpeed moves it and casts to learner.dtype.
        model, _ = replace(self.cfg.model, device="cpu", dtype="float32").load(self.cfg.seed, model_cache(self.cfg))
        self.learner = GRPOLearner(model, replace(self.cfg.learner, device=device))
        return self.learner.version

    def train(self, rollouts: Rollouts) -> LearnerUpdate:
        """GRPO on this rank's shard: log-probs under the current policy, then the update.

        The old log-probs are the learner's own, not the rollout engine's sampling log-probs
        (another replica and dtype, prepacked kernels): the ratio must compare like with like.
        The sampling log-probs serve `loss.mismatch_correction` only, which weights the loss by
        how far they are from the learner's.
        With one epoch of one mini-batch the update takes them from its own forward, and the
        separate pass (0 s) is skipped.
        """
        use_threads(self.threads)
        learner = self.learner
        samples = learner.build_samples(rollouts.prompt_ids_per_response(), rollouts.response_ids, rollouts.rewards,
                                        rollouts.group_size, truncated=rollouts.truncated(),
                                        sampler_logprobs=rollouts.logprobs)
        started = time.perf_counter()
        if not learner.old_logprobs_from_update(len(samples)):
            samples.old_logprobs = learner.compute_logprobs(samples)
        scored = time.perf_counter()
        metrics = learner.update(samples)
        done = time.perf_counter()
        return LearnerUpdate(metrics, scored - started, done - scored, sum(samples.sequence_lengths()))

    def policy_weights(self) -> VersionedWeights:
        """The current policy, its weights on rank 0 only (ZeRO-3 gathers the weights collectively,
        so every rank takes part)."""
        if self.rank != 0:
            with self.learner.gathered_state():
                return VersionedWeights(self.learner.version, None)
        with self.learner.gathered_state() as state:
            # Ray copies the returned buffers into the object store, so the next sync may reuse them.
            self.packed = FlatWeights.pack(state, resolve_dtype(self.cfg.model.dtype), into=self.packed)
        return VersionedWeights(self.learner.version, self.packed)

    def sync_plan(self) -> BucketPlan:
        """The buckets the policy is streamed in: the replicas' dtype, `cluster.weight_sync_bucket_bytes`."""
        return BucketPlan.of(self.learner.module, resolve_dtype(self.cfg.model.dtype),
                             self.cfg.cluster.weight_sync_bucket_bytes)

    def open_weight_sync(self) -> tuple[MasterAddress, BucketPlan]:
        """Rank 0: listen for the weight-sync group; where, and the plan every member follows."""
        self.sync_store, address = rendezvous(self.cfg.cluster.master_port_range, self.cfg.cluster.remote_timeout_s)
        return address, self.sync_plan()

    def weight_sync_device(self) -> MemberDevice:
        return member_device(torch.device(self.learner.device))

    def join_weight_sync(self, address: MasterAddress, rank: int, size: int, backend: str, plan: BucketPlan,
                         timeout_s: float) -> None:
        """Rank 0 joins the weight-sync group as its rank 0 (the sender)."""
        self.sync = SyncGroup.join(address, rank, size, backend, plan, timeout_s, store=self.sync_store)

    def send_policy(self) -> int:
        """Stream the current policy to the weight-sync group (rank 0); every rank takes part in the
        gathers, one bucket's parameters at a time under ZeRO-3. Returns the policy version."""
        version = self.learner.version
        if self.rank == 0:
            self.sync.send(version, lambda bucket: self.learner.gathered_state(bucket.names))
        elif self.learner.cfg.zero_stage == 3:
            for bucket in self.sync_plan().buckets:
                with self.learner.gathered_state(bucket.names):
                    pass
        return version

    def response_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """Log-probs of given responses under the current policy at the training temperature."""
        samples = GRPOSamples(prompt_ids, response_ids, torch.zeros(len(response_ids)))
        return [lp.tolist() for lp in self.learner.compute_logprobs(samples)]

    def save(self, root: str, step: int, data_position: dict, heads: HeadsState | None, wandb_run_id: str | None,
             run_config: dict, keep_last: int, drafter: list | None = None, draft_history: list | None = None) -> str:
        """Write the run checkpoint for `step` (completed steps) under `root`; returns its path."""
        path = save_checkpoint(self.learner, root, step, data_position=data_position, heads=heads,
                               wandb_run_id=wandb_run_id, run_config=run_config, keep_last=keep_last, drafter=drafter,
                               draft_history=draft_history)
        return str(path)

    def restore(self, path: str) -> ResumeState:
        """Load a checkpoint into this rank; returns what the driver resumes from."""
        # The driver verified the files against the marker before starting us: hashing is not repeated per rank.
        resumed = load_checkpoint(self.learner, Path(path), verify=False)
        self.learner.apply_optimizer_settings()  # a change resume_allow_changes let through takes effect
        return resumed
