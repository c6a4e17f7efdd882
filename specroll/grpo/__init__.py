"""GRPO math: group advantages, KL estimators, the policy loss, its variants and its aggregation.

Pure torch functions without I/O; the learner wires them to models and optimizers.
"""

from specroll.grpo.advantages import ON_INVALID_MODES, check_rewards, group_advantages
from specroll.grpo.aggregation import AGGREGATION_MODES, aggregate, aggregation_denominator
from specroll.grpo.entropy import entropy_from_logits, high_entropy_mask
from specroll.grpo.kl import KL_ESTIMATORS, kl_estimate
from specroll.grpo.loss import (
    IMPORTANCE_LEVELS,
    SURROGATES,
    PolicyLossConfig,
    importance_log_ratio,
    policy_loss,
    valid_token_mask,
)
from specroll.grpo.mismatch import MISMATCH_MODES, mismatch_weights
from specroll.grpo.overlong import soft_overlong_penalty

__all__ = [
    "AGGREGATION_MODES",
    "IMPORTANCE_LEVELS",
    "KL_ESTIMATORS",
    "MISMATCH_MODES",
    "ON_INVALID_MODES",
    "PolicyLossConfig",
    "SURROGATES",
    "aggregate",
    "aggregation_denominator",
    "check_rewards",
    "entropy_from_logits",
    "group_advantages",
    "high_entropy_mask",
    "importance_log_ratio",
    "kl_estimate",
    "mismatch_weights",
    "policy_loss",
    "soft_overlong_penalty",
    "valid_token_mask",
]
