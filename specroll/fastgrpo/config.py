"""Configuration of the FastGRPO-style baseline (mirrored by conf/rollout/fastgrpo.yaml)."""
from __future__ import annotations

from dataclasses import dataclass, field

from specroll.config_checks import check_bool, check_int, check_number, check_positive, require


@dataclass
class OnlineConfig:
    """Online draft learning after every step, on the step's response tokens (FastGRPO's schedule)."""

    enabled: bool = True  # false: the drafter stays as loaded (FastGRPO without online learning)
    lr: float = 1e-4  # AdamW learning rate
    feature_weight: float = 2.0  # weight of SmoothL1(predicted feature, policy feature)
    ce_weight: float = 0.1  # weight of the soft cross-entropy of draft vs policy next-token distributions
    epochs: int = 1  # passes over the step's tokens
    batch_tokens: int = 4096  # response tokens per optimiser step
    chunk_tokens: int = 512  # tokens per LM-head product in the loss (memory: chunk x vocab floats)
    max_grad_norm: float = 1.0  # gradient clipping

    def __post_init__(self) -> None:
        check_bool("enabled", self.enabled)
        check_positive("lr", self.lr)
        check_number("feature_weight", self.feature_weight, 0)
        check_number("ce_weight", self.ce_weight, 0)
        require(self.feature_weight + self.ce_weight > 0, "ce_weight", self.ce_weight, "> 0 when feature_weight is 0",
                why="the loss would be 0")
        for name in ("epochs", "batch_tokens", "chunk_tokens"):
            check_int(name, getattr(self, name), 1)
        check_positive("max_grad_norm", self.max_grad_norm)


@dataclass
class FastGRPOConfig:
    # Trained drafter file; "shipped" = SpecRoll's drafter for this model (untrained if none ships);
    # None = a freshly initialised drafter.
    drafter_path: str | None = "shipped"
    # C of N = max(2, min(floor(C / B), max_nodes)); None = this hardware's profiled C_hw (SpecRoll's
    # `concurrency` budget uses the same). FastGRPO used 160 on an H800.
    capacity: int | None = None
    max_nodes: int = 160  # N_max nodes per response, root included
    max_width: int = 8  # K = min(N - 1, max_width): children per expanded node, nodes expanded per level
    min_depth: int = 3  # L = clamp(floor(log2(N / depth_scale)), min_depth, max_depth) levels drafted
    max_depth: int = 5  # deepest level drafted (and the verify pass's deepest acceptance)
    depth_scale: float = 0.75  # see min_depth
    profile_cache_len: int = 256  # cache length the hardware profile is measured at (capacity None)
    online: OnlineConfig = field(default_factory=OnlineConfig)  # online draft learning each step

    def __post_init__(self) -> None:
        if self.capacity is not None:
            check_int("capacity", self.capacity, 1)
        check_int("max_nodes", self.max_nodes, 2, why="the root and one draft")
        check_int("max_width", self.max_width, 1)
        check_int("max_depth", self.max_depth, 1)
        check_int("min_depth", self.min_depth, 1, self.max_depth)
        check_positive("depth_scale", self.depth_scale)

    @property
    def max_tokens_per_step(self) -> int:
        """Most tokens one verify pass appends per row (the root and its tree)."""
        return self.max_nodes if self.capacity is None else max(2, min(self.capacity, self.max_nodes))
