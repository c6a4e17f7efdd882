"""Exact speculative rollouts: horizon heads, sparse draft trees, one-pass tree verification."""
from .adaptation.drift_detector import DriftConfig, DriftDetector, HeadTelemetry
from .adaptation.replay import MaturedRecords, ReplayMemory
from .budgets.hardware_profile import HardwareProfile, get_profile, measure_profile
from .config import SpeculationConfig
from .decoder import SpeculativeDecoder
from .drafting.heads import HorizonHeads, shipped_heads
from .drafting.tree import DraftTree, draft_candidates, select_tree, tree_attention_mask
from .verification.verify import verify_tree

__all__ = [
    "DraftTree",
    "DriftConfig",
    "DriftDetector",
    "HardwareProfile",
    "HeadTelemetry",
    "HorizonHeads",
    "MaturedRecords",
    "ReplayMemory",
    "SpeculationConfig",
    "SpeculativeDecoder",
    "draft_candidates",
    "get_profile",
    "measure_profile",
    "select_tree",
    "shipped_heads",
    "tree_attention_mask",
    "verify_tree",
]
