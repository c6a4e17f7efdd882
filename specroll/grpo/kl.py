"""Per-token estimators of the KL divergence between the sampling policy and a reference.

With tokens sampled from the policy and ``d = logp_ref - logp`` (the log of ``p_ref / p``),
Schulman's estimators of ``KL(policy || reference)`` are:

- ``k1 = -d``: unbiased, high variance, can be negative;
- ``k2 = 0.5 * d**2``: biased, low variance, never negative;
- ``k3 = exp(d) - d - 1``: unbiased, low variance, never negative (the default).

See http://joschu.net/blog/kl-approx.html.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_estimate(
    logp: Tensor,
    logp_ref: Tensor,
    estimator: KLEstimator = "k3",
    log_ratio_clamp: float | None = None,
) -> Tensor:
    """Elementwise KL estimate from log-probabilities of the sampled tokens.

    Args:
        logp: log-probabilities under the policy the tokens were sampled from.
        logp_ref: log-probabilities of the same tokens under the reference.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (see module docstring).
        log_ratio_clamp: if given, ``logp_ref - logp`` is clamped to
            ``[-log_ratio_clamp, log_ratio_clamp]`` first, because ``exp`` in ``k3`` overflows
            float32 beyond ~88.

    Returns:
        A tensor shaped like ``logp``.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    log_ratio = logp_ref - logp
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    return torch.exp(log_ratio) - log_ratio - 1.0
