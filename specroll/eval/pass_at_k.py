"""The unbiased pass@k estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on Code")."""
from __future__ import annotations

from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that at least one of `k` responses drawn without replacement from `n` sampled ones,
    `c` of them correct, is correct: 1 - C(n - c, k) / C(n, k).

    Exact (integer binomials), so it is 1.0 whenever fewer than `k` responses are wrong.
    """
    if not 0 <= c <= n:
        raise ValueError(f"correct responses c ({c}) must be in [0, n] with n = {n}")
    if not 1 <= k <= n:
        raise ValueError(f"k ({k}) must be in [1, n] with n = {n} sampled responses")
    return 1.0 - comb(n - c, k) / comb(n, k)
