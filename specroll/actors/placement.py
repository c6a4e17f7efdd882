"""Where an actor runs: its Ray resources, device and CPU threads, all from the config.

Actors are plain classes; `as_remote` wraps one for Ray only when it is created, so tests
and notebooks can also build them in-process.
"""
from __future__ import annotations

import ray
import torch


def as_remote(cls: type, num_cpus: float, num_gpus: float = 0.0):
    """`cls` as a Ray actor class reserving `num_cpus` CPUs and `num_gpus` GPUs.

    A dead actor is not restarted: its state (weights, optimizer) would be lost, so the
    run fails with a named error and resumes from its last checkpoint instead.
    """
    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0)(cls)


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
