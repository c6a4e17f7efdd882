"""The GRPO learner: DeepSpeed-wrapped policy updates, run checkpoints and HF export."""
from .batching import GRPOSamples, MicroBatch, loss_normalizer, micro_batch_indices, mini_batch_indices, pad_samples
from .checkpoint import (
    CheckpointDamagedError,
    ResumeState,
    RngState,
    export_hf,
    latest_intact_checkpoint,
    load_checkpoint,
    policy_weights,
    save_checkpoint,
    verify_checkpoint,
)
from .collectives import ensure_distributed
from .config import LearnerConfig
from .grpo_learner import GRPOLearner, build_ds_config, build_engine, lr_multiplier
from .lineage import MIN_KEEP_LAST, latest_checkpoint, start_branch
from .logprobs import ResponseLogprobs, sequence_logprobs

__all__ = [
    "CheckpointDamagedError",
    "GRPOLearner",
    "GRPOSamples",
    "LearnerConfig",
    "MIN_KEEP_LAST",
    "MicroBatch",
    "ResponseLogprobs",
    "ResumeState",
    "RngState",
    "build_ds_config",
    "build_engine",
    "ensure_distributed",
    "export_hf",
    "latest_checkpoint",
    "latest_intact_checkpoint",
    "load_checkpoint",
    "loss_normalizer",
    "lr_multiplier",
    "micro_batch_indices",
    "mini_batch_indices",
    "pad_samples",
    "policy_weights",
    "save_checkpoint",
    "sequence_logprobs",
    "start_branch",
    "verify_checkpoint",
]
