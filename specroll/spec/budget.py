"""Node budget: how many tree nodes (root included) each response gets in a verify step.

N_t = 1 is plain decoding. `concurrency` follows the shrinking number of unfinished
responses B_t: N_t = clamp(floor(C_hw / B_t), N_min, N_max). `cost_model` picks the N_t that
maximises expected accepted tokens per second from the profiled verify latency plus the
measured drafting time, and skips drafting when not even perfect drafts could pay.
"""
from __future__ import annotations

import torch

from .profile import HardwareProfile

BUDGET_POLICIES = ("fixed", "concurrency", "cost_model")


def concurrency_budget(capacity: int, active_rows: int, min_nodes: int, max_nodes: int) -> int:
    return max(min_nodes, min(max_nodes, capacity // max(active_rows, 1)))


def cost_model_budget(expected_tokens: torch.Tensor, profile: HardwareProfile, active_rows: int,
                      min_nodes: int, max_nodes: int, draft_s: float = 0.0) -> int:
    """argmax_N  sum_b E[tokens_b | N] / (T(B, N) + drafting time if N > 1);
    expected_tokens [B, max_nodes] for N = 1..max_nodes."""
    total = expected_tokens.sum(dim=0).tolist()  # one host sync, not one per N
    best_n, best_rate = min_nodes, -1.0
    for n in range(min_nodes, max_nodes + 1):
        rate = total[n - 1] / (profile.latency(active_rows, n) + (draft_s if n > 1 else 0.0))
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n


def speculation_may_pay(profile: HardwareProfile, active_rows: int, max_nodes: int, max_depth: int,
                        draft_s: float) -> bool:
    """Whether some N > 1 could beat plain decoding even if every draft on a chain were accepted
    (N nodes emit at most min(N, depth + 1) tokens). If not, the step need not draft at all."""
    plain_rate = 1.0 / profile.latency(active_rows, 1)
    return any(min(n, max_depth + 1) / (profile.latency(active_rows, n) + draft_s) > plain_rate
               for n in range(2, max_nodes + 1))
