"""The Ray cluster a run starts for itself: this machine's alone, every port on the loopback address.

Ray turns `_node_ip_address="127.0.0.1"` into the machine's outward address unless multi-node
clusters are off (`ray_constants.ENABLE_RAY_CLUSTER`, off by default on macOS and Windows), and
binds the GCS, raylet, object manager, workers and agents to all interfaces for an outward node
address. With clusters off while it starts, all of them, metrics endpoints included, bind the
loopback address; no dashboard is started. A cluster of several nodes is not started here (see
docs/guide.md on what it exposes).
"""
from __future__ import annotations

import ray
from ray._private import ray_constants

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
