"""Exact speculative rollouts: horizon heads, sparse draft trees, one-pass tree verification."""
from .config import SpecConfig
from .decoder import SpecDecoder
from .drift import DriftConfig, DriftDetector, HeadTelemetry
from .heads import HorizonHeads, shipped_heads
from .profile import HardwareProfile, get_profile, measure_profile
from .replay import MaturedRecords, ReplayMemory
from .tree import DraftTree, draft_candidates, select_tree, tree_attention_mask
from .verify import verify_tree

__all__ = [
    "DraftTree",
    "DriftConfig",
    "DriftDetector",
    "HardwareProfile",
    "HeadTelemetry",
    "HorizonHeads",
    "MaturedRecords",
    "ReplayMemory",
    "SpecConfig",
    "SpecDecoder",
    "draft_candidates",
    "get_profile",
    "measure_profile",
    "select_tree",
    "shipped_heads",
    "tree_attention_mask",
    "verify_tree",
]
