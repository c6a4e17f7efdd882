"""GRPO math: group advantages, KL estimators, the clipped policy loss and its aggregation.

Pure torch functions without I/O; the learner wires them to models and optimizers.
"""

from specroll.grpo.advantages import ON_INVALID_MODES, check_rewards, group_advantages
from specroll.grpo.aggregation import AGGREGATION_MODES, aggregate, aggregation_denominator
from specroll.grpo.entropy import entropy_from_logits
from specroll.grpo.kl import KL_ESTIMATORS, kl_estimate
from specroll.grpo.loss import PolicyLossConfig, policy_loss, valid_token_mask

__all__ = [
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "ON_INVALID_MODES",
    "PolicyLossConfig",
    "aggregate",
    "aggregation_denominator",
    "check_rewards",
    "entropy_from_logits",
    "group_advantages",
    "kl_estimate",
    "policy_loss",
    "valid_token_mask",
]
