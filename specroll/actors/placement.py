"""Where an actor runs: its Ray resources, placement group, device and CPU threads, all from the config.

Actors are plain classes; `as_remote` wraps one for Ray only when it is created, so tests
and notebooks can also build them in-process.

The learner's ranks are reserved as one placement group packed on as few nodes as their
GPUs allow (NCCL inside a node is far faster than between nodes), rank r in bundle r; the
rollout actors as one group spread over the nodes (each brings its own GPU and its share of
the network). The head-consolidation actor, a GPU share beside a rollout actor's, is placed
by its resources alone.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from specroll.configs import ClusterConfig, TrainConfig

from .remote_calls import ActorTimeoutError


def as_remote(cls: type, num_cpus: float, num_gpus: float = 0.0, resources: dict[str, float] | None = None):
    """`cls` as a Ray actor class reserving `num_cpus` CPUs, `num_gpus` GPUs and custom `resources`
    (which place it on the nodes offering them).

    A dead actor is not restarted: its state (weights, optimizer) would be lost, so the
    run fails with a named error and resumes from its last checkpoint instead.
    """
    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or {}, max_restarts=0)(cls)


def local_resources(cluster: ClusterConfig) -> dict[str, float]:
    """The custom resources all of `cluster`'s actors ask for together: what a one-node cluster
    offers so that a config placing them on several nodes also runs on one."""
    offered: dict[str, float] = {}
    for asked, count in ((cluster.rollout_resources, cluster.num_rollout_actors),
                         (cluster.learner_resources, cluster.learner_world_size),
                         (cluster.consolidation_resources, 1)):
        for name, amount in asked.items():
            offered[name] = offered.get(name, 0.0) + amount * count
    return offered


def in_ray_actor() -> bool:
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def actor_device(configured: str) -> str:
    """`configured`, except that "auto" inside a Ray actor means the GPU Ray reserved for it,
    if any, else the CPU: an actor never takes a GPU it did not ask for."""
    if configured != "auto" or not in_ray_actor():
        return configured
    return "cuda" if ray.get_gpu_ids() else "cpu"


def model_cache(cfg: TrainConfig) -> Path | None:
    """Where an actor loads the model from: inside a Ray actor, the copy the driver staged
    (`ModelConfig.stage`); None for one built in-process (tests, notebooks, benchmarks), which
    resolves the model itself as the only process there is."""
    return cfg.model_cache if in_ray_actor() else None


def use_cpus(num_cpus: float) -> None:
    """One torch thread per reserved CPU: more threads than cores only wait on each other."""
    if in_ray_actor():
        torch.set_num_threads(max(1, int(num_cpus)))


def bundle(cpus: float, gpus: float, resources: Mapping[str, float]) -> dict[str, float]:
    """One actor's reservation as a placement-group bundle: Ray refuses amounts of zero."""
    return {name: amount for name, amount in {"CPU": cpus, "GPU": gpus, **resources}.items() if amount > 0}


def fits_one_node(bundles: list[dict[str, float]], nodes: list[Mapping[str, float]]) -> bool:
    """Whether some node's total resources hold all `bundles` at once."""
    needed: dict[str, float] = {}
    for b in bundles:
        for name, amount in b.items():
            needed[name] = needed.get(name, 0.0) + amount
    return any(all(node.get(name, 0.0) >= amount for name, amount in needed.items()) for node in nodes)


def learner_strategy(bundles: list[dict[str, float]], nodes: list[Mapping[str, float]]) -> str:
    """STRICT_PACK (one node, never split) where some node holds every rank, else PACK (as few nodes as they fit)."""
    return "STRICT_PACK" if fits_one_node(bundles, nodes) else "PACK"


class Placement(NamedTuple):
    """The placement groups of a run's learner ranks and rollout actors."""

    learner: PlacementGroup  # bundle r: learner rank r
    rollout: PlacementGroup  # bundle i: rollout actor i

    def learner_rank(self, rank: int) -> dict:
        """`options` placing learner rank `rank` in its bundle."""
        return in_bundle(self.learner, rank)

    def rollout_actor(self, index: int) -> dict:
        """`options` placing rollout actor `index` in its bundle."""
        return in_bundle(self.rollout, index)

    def remove(self) -> None:
        for group in self:
            remove_placement_group(group)


def in_bundle(group: PlacementGroup, index: int) -> dict:
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)}


def reserve(cluster: ClusterConfig, timeout_s: float) -> Placement:
    """Reserve the learner's and the rollout actors' resources on the Ray cluster `ray.init` joined;
    waits at most `timeout_s` for the cluster to offer them (an autoscaler may be adding nodes)."""
    c = cluster
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    learners = [bundle(c.cpus_per_learner, c.gpus_per_learner, c.learner_resources)] * c.learner_world_size
    rollout = [bundle(c.cpus_per_rollout_actor, c.gpus_per_rollout_actor, c.rollout_resources)] * c.num_rollout_actors
    strategy = learner_strategy(learners, nodes)
    placement = Placement(placement_group(learners, strategy=strategy), placement_group(rollout, strategy="SPREAD"))
    ready, _ = ray.wait([group.ready() for group in placement], num_returns=2, timeout=timeout_s)
    if len(ready) < 2:
        placement.remove()
        offered = "; ".join(", ".join(f"{k}={v:g}" for k, v in sorted(n.items()) if not k.startswith("node:"))
                            for n in nodes)
        raise ActorTimeoutError(
            f"the Ray cluster did not offer, within {timeout_s:g} s (cluster.remote_timeout_s), the learner's "
            f"{len(learners)} x {learners[0]} ({strategy}) and the rollout actors' {len(rollout)} x {rollout[0]} "
            f"(SPREAD); its nodes offer: {offered or 'nothing'}")
    return placement
