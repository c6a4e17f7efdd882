"""How many torch threads each actor runs while its phase of a step runs.

Without `cluster.overlap` rollouts and learner updates alternate, so the active side has the
whole node, shared evenly by its actors. With overlap both sides run at once and the node is
split between them in proportion to the CPUs they reserve. An actor on a GPU keeps one thread
per reserved CPU (its threads only feed the GPU); a CPU side running alongside gets the rest.
The actors of a side are taken to share one node, as on a local cluster.

Ray's `num_cpus` stays what placement counts: Ray starts each actor with OMP_NUM_THREADS set
from it, and `torch.set_num_threads` at the start of a phase overrides that. On a machine shared
with other busy processes threads beyond a process's share mostly wait for each other (Ray runs
actors at a low priority), so `cluster.phase_threads=false` keeps one per reserved CPU.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from specroll.configs import ClusterConfig

from .placement import in_ray_actor


@dataclass(frozen=True)
class PhaseThreads:
    """Torch threads of each actor of a side while its phase runs."""

    rollout: int  # each rollout actor, while it generates
    learner: int  # each learner rank, while it trains (old log-probs and update)


def reserved_threads(num_cpus: float) -> int:
    """One thread per reserved CPU, at least one."""
    return max(1, int(num_cpus))


def phase_threads(cluster: ClusterConfig, cores: int) -> PhaseThreads:
    """Threads per actor on a node of `cores` cores; see the module docstring for the rule.

    With overlap the rollout side's share is `cores * R / (R + L)` rounded half up, where R and L
    are the CPUs each side reserves in total, and each side keeps at least one core.
    """
    c = cluster
    if not c.phase_threads:
        return PhaseThreads(reserved_threads(c.cpus_per_rollout_actor), reserved_threads(c.cpus_per_learner))
    rollout_on_gpu, learner_on_gpu = c.gpus_per_rollout_actor > 0, c.gpus_per_learner > 0
    rollout_gpu_threads = reserved_threads(c.cpus_per_rollout_actor)
    learner_gpu_threads = reserved_threads(c.cpus_per_learner)
    if not c.overlap:
        rollout_cores = learner_cores = cores
    elif rollout_on_gpu or learner_on_gpu:
        rollout_cores = cores - (learner_gpu_threads * c.learner_world_size if learner_on_gpu else 0)
        learner_cores = cores - (rollout_gpu_threads * c.num_rollout_actors if rollout_on_gpu else 0)
    else:
        rollout_cpus = c.num_rollout_actors * c.cpus_per_rollout_actor
        learner_cpus = c.learner_world_size * c.cpus_per_learner
        rollout_cores = int(cores * rollout_cpus / (rollout_cpus + learner_cpus) + 0.5)
        rollout_cores = min(max(rollout_cores, 1), max(cores - 1, 1))
        learner_cores = max(cores - rollout_cores, 1)
    return PhaseThreads(
        rollout=rollout_gpu_threads if rollout_on_gpu else max(1, rollout_cores // c.num_rollout_actors),
        learner=learner_gpu_threads if learner_on_gpu else max(1, learner_cores // c.learner_world_size),
    )


def node_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def use_threads(threads: int) -> None:
    """Set this actor's torch threads (inside a Ray actor only: in-process use keeps the caller's)."""
    if in_ray_actor():
        torch.set_num_threads(threads)
