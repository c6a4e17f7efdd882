"""FastGRPO's dynamic tree rule (docs/algorithm.md, section 8): nodes, depth and width from concurrency.

With B unfinished responses and hardware capacity C (total tree nodes a verify pass may
hold), each response gets N = max(2, min(floor(C / B), N_max)) nodes (root included), so
FastGRPO always drafts at least one token. Drafting runs L = clamp(floor(log2(N / 0.75)),
3, 5) levels deep, expanding the K = min(N - 1, 8) best nodes of each level by cumulative
confidence, and the tree is the N - 1 globally best drafted nodes.
"""
from __future__ import annotations

import math
from typing import NamedTuple


class TreeShape(NamedTuple):
    nodes: int  # N, root included
    depth: int  # L, levels drafted
    width: int  # K, children per expanded node and nodes expanded per level


def nodes_per_response(capacity: int, active_rows: int, max_nodes: int) -> int:
    """N = max(2, min(floor(C / B), N_max))."""
    return max(2, min(capacity // max(active_rows, 1), max_nodes))


def tree_shape(nodes: int, min_depth: int = 3, max_depth: int = 5, depth_scale: float = 0.75,
               max_width: int = 8) -> TreeShape:
    """(N, L, K) for a budget of N nodes: L = clamp(floor(log2(N / depth_scale)), min_depth, max_depth),
    K = min(N - 1, max_width)."""
    if nodes < 2:
        raise ValueError(f"a FastGRPO tree has at least 2 nodes (root and one draft), got {nodes}")
    depth = min(max(math.floor(math.log2(nodes / depth_scale)), min_depth), max_depth)
    return TreeShape(nodes, depth, min(nodes - 1, max_width))


def levels_worth_drafting(shape: TreeShape) -> int:
    """Levels whose nodes can enter the tree: the best N - 1 nodes form a connected tree, so
    none lies deeper than N - 1; drafting deeper changes nothing but the time spent."""
    return min(shape.depth, shape.nodes - 1)
