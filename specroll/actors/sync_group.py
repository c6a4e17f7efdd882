"""The weight-sync group: learner rank 0 streams the policy to the rollout (and head-consolidation)
actors over a process group of their own, one bucket at a time (`cluster.weight_sync=collective`).

Ranks: learner rank 0 is 0, rollout actor i is 1 + i, the head-consolidation actor (slow path) the
last. Rank 0 listens at its node's address on a port of `cluster.master_port_range` (`rendezvous`); the driver hands that address, the
`BucketPlan` and the backend (`group_backend` of the members' devices) to every member, which joins
once, at start. A sync: the learner ranks gather one bucket's parameters at a time (ZeRO-3), rank 0
packs the bucket and broadcasts it, each receiver copies it into its weights; a last message carries
the policy version and the bytes sent, which each receiver checks against the version the driver
named before it counts as holding that version. A dead member fails the others' collectives within
the group's timeout instead of hanging them.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import ray
import torch

from specroll.learner.collectives import ProcessGroup, Store, device_for, group_of_its_own, group_store
from specroll.models.weight_buckets import Bucket, BucketPlan, pack_bucket

from .rendezvous import MasterAddress, node_address, rendezvous_point

Gathered = Callable[[Bucket], AbstractContextManager[Mapping[str, torch.Tensor]]]


class MemberDevice(NamedTuple):
    """Where a member's weights live, as the choice of backend needs it."""

    type: str  # "cpu" or "cuda"
    gpu: str | None  # the GPU it holds, "<node id>/<Ray's GPU ids>" (actors sharing a GPU name the same); None on a CPU


def member_device(device: torch.device) -> MemberDevice:
    if device.type != "cuda":
        return MemberDevice(device.type, None)
    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
    gpus = ray.get_gpu_ids() if ray.is_initialized() else [device.index]
    return MemberDevice("cuda", f"{node}/{','.join(map(str, gpus))}")


def group_backend(devices: list[MemberDevice]) -> str:
    """NCCL where every member holds a GPU of its own (NCCL refuses two ranks on one GPU, as a
    consolidation actor sharing a rollout actor's GPU would be), else gloo, through host memory."""
    gpus = [device.gpu for device in devices]
    return "nccl" if all(gpus) and len(set(gpus)) == len(gpus) else "gloo"


def rendezvous(port_range: tuple[int, int], timeout_s: float) -> tuple[Store, MasterAddress]:
    """Rank 0's store, listening at its node's address on a free port of `port_range`
    (`cluster.master_port_range`), and that address, for the other members."""
    address = rendezvous_point(port_range)
    return group_store(address.host, address.port, timedelta(seconds=timeout_s), None, leader=True), address


@dataclass
class SyncGroup:
    """One member's end of the group, with its one bucket of buffer."""

    group: ProcessGroup
    rank: int
    plan: BucketPlan
    buffer: torch.Tensor  # uint8 [plan.largest] on the group's device: the CPU under gloo, this GPU under NCCL

    @classmethod
    def join(cls, address: MasterAddress, rank: int, size: int, backend: str, plan: BucketPlan, timeout_s: float,
             store: Store | None = None) -> "SyncGroup":
        """Join as `rank` of `size` (blocks until all have joined); rank 0 passes `rendezvous`'s store."""
        if store is None:
            store = group_store(address.host, address.port, timedelta(seconds=timeout_s), size, leader=False)
        group = group_of_its_own(store, rank, size, backend, node_address(), timeout_s)
        device = device_for(backend, torch.cuda.current_device() if backend == "nccl" else 0)
        return cls(group, rank, plan, torch.empty(plan.largest, dtype=torch.uint8, device=device))

    def send(self, version: int, gathered: Gathered) -> int:
        """Rank 0: every bucket, `gathered(bucket)` giving its tensors by name, then the closing
        message; returns the bytes broadcast."""
        for bucket in self.plan.buckets:
            with gathered(bucket) as tensors:
                flat = pack_bucket(bucket, tensors, self.buffer)
            self.broadcast(flat)
        self.broadcast(self.closing(version, self.plan.nbytes))
        return self.plan.nbytes

    def receive(self, version: int, on_bucket: Callable[[Bucket, torch.Tensor], None]) -> None:
        """Every bucket, handed to `on_bucket` with its bytes (reused for the next), then the closing
        message: raises ValueError unless it names `version` and the bytes the plan has."""
        for bucket in self.plan.buckets:
            flat = self.buffer[: bucket.nbytes]
            self.broadcast(flat)
            on_bucket(bucket, flat)
        closing = self.closing(-1, -1)
        self.broadcast(closing)
        sent_version, sent_bytes = closing.tolist()
        if (sent_version, sent_bytes) != (version, self.plan.nbytes):
            raise ValueError(f"weight sync sent policy version {sent_version} ({sent_bytes} bytes) where version "
                             f"{version} ({self.plan.nbytes} bytes) was expected")

    def closing(self, version: int, nbytes: int) -> torch.Tensor:
        return torch.tensor([version, nbytes], dtype=torch.int64, device=self.buffer.device)

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast([tensor]).wait()
