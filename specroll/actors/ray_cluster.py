"""The Ray cluster a run joins (`cluster.ray_address`, $RAY_ADDRESS) or, without one, starts for
itself: this machine's alone, every port on the loopback address.

Ray turns `_node_ip_address="127.0.0.1"` into the machine's outward address unless multi-node
clusters are off (`ray_constants.ENABLE_RAY_CLUSTER`, off by default on macOS and Windows), and
binds the GCS, raylet, object manager, workers and agents to all interfaces for an outward node
address. With clusters off while it starts, all of them, metrics endpoints included, bind the
loopback address; no dashboard is started. A cluster of several nodes is not started here (see
docs/guide.md on what it exposes).
"""
from __future__ import annotations

import math
import os

import ray
import torch
from ray._private import ray_constants

from specroll.configs import ClusterSection

from .placement import local_resources

LOOPBACK = "127.0.0.1"


def start_local_cluster(num_cpus: int, resources: dict[str, float]) -> None:
    """`ray.init` of a new one-node cluster on the loopback address, even where another cluster runs here."""
    clusters = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False  # only for the start: a later ray.init may join a real cluster
    try:
        # worker_niceness 0: Ray's default (15) lets any other busy process starve the actors doing the run's work.
        ray.init(address="local", num_cpus=num_cpus, resources=resources, include_dashboard=False,
                 dashboard_host=LOOPBACK, _node_ip_address=LOOPBACK, _system_config={"worker_niceness": 0})
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = clusters


def connect_ray(cluster: ClusterSection) -> bool:
    """Join `cluster.ray_address` (or the job's $RAY_ADDRESS), or start a local cluster on the loopback
    address (`start_local_cluster`); True if started here."""
    if ray.is_initialized():
        return False
    address = cluster.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        try:
            ray.init(address=address)
        except ConnectionError as exc:
            raise ConnectionError(f"cannot reach the Ray cluster at {address} (cluster.ray_address or $RAY_ADDRESS): "
                                  f"{str(exc).splitlines()[0]}; start it (ray start --head) or unset both for a "
                                  "local cluster") from exc
        return True
    c = cluster
    gpus = c.num_rollout_actors * c.gpus_per_rollout_actor + c.learner_world_size * c.gpus_per_learner
    if gpus > torch.cuda.device_count():
        raise ValueError(f"cluster.gpus_per_rollout_actor / cluster.gpus_per_learner ask for {gpus:g} GPUs; "
                         f"this machine has {torch.cuda.device_count()}")
    cpus = c.num_rollout_actors * c.cpus_per_rollout_actor + c.learner_world_size * c.cpus_per_learner
    # Ray's CPUs are bookkeeping: a laptop with fewer cores still runs the config, just slower.
    start_local_cluster(max(os.cpu_count() or 1, math.ceil(cpus)), local_resources(c))
    return True
