"""Where a process group's rank 0 listens: its node's address and a port from the configured range.

The learner's group (and any other group rank 0 leads, such as a weight-sync group) meets at
the address rank 0 advertises. It must be the node's address as the other nodes reach it, never
127.0.0.1, and a port the cluster's firewall lets through: `cluster.master_port_range`.
"""
from __future__ import annotations

import random
import socket
from collections.abc import Collection
from typing import NamedTuple

import ray


class MasterAddress(NamedTuple):
    """Where rank 0 of a process group listens."""

    host: str  # its node's address (127.0.0.1 outside Ray)
    port: int  # a port of the configured range that was free there


def node_address() -> str:
    """This process's node address as Ray's other nodes reach it; 127.0.0.1 outside Ray."""
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def free_port_in(port_range: tuple[int, int], avoid: Collection[int] = ()) -> int:
    """A port of `port_range` (inclusive) that nothing on this node listens on, other than `avoid`.

    Probed on all interfaces, as the group's store binds: a port free on 127.0.0.1 alone may be
    taken on the node's address. The probe starts at a random port of the range, so groups
    started at once on one node (two runs, the learner's and a sync group) rarely pick the same.
    """
    low, high = port_range
    ports = list(range(low, high + 1))
    start = random.randrange(len(ports))
    for port in ports[start:] + ports[:start]:
        if port in avoid:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in cluster.master_port_range [{low}, {high}] on {node_address()}: "
                       "widen the range or stop what listens there")


def rendezvous_point(port_range: tuple[int, int], avoid: Collection[int] = ()) -> MasterAddress:
    """Where a group led by this process meets: called inside its rank 0's actor."""
    return MasterAddress(node_address(), free_port_in(port_range, avoid))
