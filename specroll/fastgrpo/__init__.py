"""The FastGRPO-style baseline (docs/algorithm.md, section 8): a one-layer feature drafter, its dynamic
tree rule, SpecRoll's exact verification, and online draft learning every step."""
from .config import FastGRPOConfig, OnlineConfig
from .decoder import FastGRPODecoder
from .drafter import FeatureDrafter, initial_drafter, shipped_drafter
from .feature_log import DraftSequences, teacher_forced_sequences
from .tree_rule import TreeShape, nodes_per_response, tree_shape

__all__ = [
    "DraftSequences",
    "FastGRPOConfig",
    "FastGRPODecoder",
    "FeatureDrafter",
    "OnlineConfig",
    "TreeShape",
    "initial_drafter",
    "nodes_per_response",
    "shipped_drafter",
    "teacher_forced_sequences",
    "tree_shape",
]
