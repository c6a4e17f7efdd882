"""Where an actor runs: its Ray resources, device and CPU threads, all from the config.

Actors are plain classes; `as_remote` wraps one for Ray only when it is created, so tests
and notebooks can also build them in-process.
"""
from __future__ import annotations

import ray
import torch

from specroll.configs import ClusterSection


def as_remote(cls: type, num_cpus: float, num_gpus: float = 0.0, resources: dict[str, float] | None = None):
    """`cls` as a Ray actor class reserving `num_cpus` CPUs, `num_gpus` GPUs and custom `resources`
    (which place it on the nodes offering them).

    A dead actor is not restarted: its state (weights, optimizer) would be lost, so the
    run fails with a named error and resumes from its last checkpoint instead.
    """
    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or {}, max_restarts=0)(cls)


def local_resources(cluster: ClusterSection) -> dict[str, float]:
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


def use_cpus(num_cpus: float) -> None:
    """One torch thread per reserved CPU: more threads than cores only wait on each other."""
    if in_ray_actor():
        torch.set_num_threads(max(1, int(num_cpus)))
