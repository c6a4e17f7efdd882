"""Configuration of the FastGRPO-style baseline (mirrored by conf/rollout/fastgrpo.yaml)."""
from __future__ import annotations

from dataclasses import dataclass, field


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
        if self.lr <= 0:
            raise ValueError(f"online.lr must be > 0, got {self.lr}")
        if self.feature_weight < 0 or self.ce_weight < 0 or self.feature_weight + self.ce_weight == 0:
            raise ValueError("online.feature_weight and ce_weight must be >= 0, not both 0")
        for name in ("epochs", "batch_tokens", "chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"online.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_grad_norm <= 0:
            raise ValueError(f"online.max_grad_norm must be > 0, got {self.max_grad_norm}")


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
        if self.capacity is not None and self.capacity < 1:
            raise ValueError(f"fastgrpo.capacity must be >= 1 or null, got {self.capacity}")
        if self.max_nodes < 2:
            raise ValueError(f"fastgrpo.max_nodes must be >= 2 (root and one draft), got {self.max_nodes}")
        if self.max_width < 1:
            raise ValueError(f"fastgrpo.max_width must be >= 1, got {self.max_width}")
        if not 1 <= self.min_depth <= self.max_depth:
            raise ValueError(f"fastgrpo.min_depth ({self.min_depth}) must be in [1, max_depth ({self.max_depth})]")
        if self.depth_scale <= 0:
            raise ValueError(f"fastgrpo.depth_scale must be > 0, got {self.depth_scale}")

    @property
    def max_tokens_per_step(self) -> int:
        """Most tokens one verify pass appends per row (the root and its tree)."""
        return self.max_nodes if self.capacity is None else max(2, min(self.capacity, self.max_nodes))
