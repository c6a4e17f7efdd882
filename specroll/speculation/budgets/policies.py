"""Node budget: how many tree nodes (root included) each response gets in a verify step.

N_t = 1 is plain decoding. `concurrency` follows the shrinking number of unfinished
responses B_t: N_t = clamp(floor(C_hw / B_t), N_min, N_max), cut to the largest node bucket
whose trees pay, or to 1, by the tree gate (`tree_gate.py`). `cost_model` picks the N_t that
maximises expected accepted tokens per second from the profiled verify latency plus the
measured drafting time for that tree (smaller trees draft fewer depths), and skips drafting
when not even perfect drafts could pay.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .hardware_profile import HardwareProfile

BUDGET_POLICIES = ("auto", "fixed", "concurrency", "cost_model")


def resolve_budget(policy: str, device_type: str) -> str:
    """`auto` is the policy measured to pay on this kind of device: `concurrency` on GPUs, where a
    verify pass costs about one step up to C_hw tokens; `cost_model` elsewhere (CPUs), where the
    verify cost grows with the tree and only the planned trees that beat plain decoding pay."""
    if policy != "auto":
        return policy
    return "concurrency" if device_type == "cuda" else "cost_model"


def concurrency_budget(capacity: int, active_rows: int, min_nodes: int, max_nodes: int) -> int:
    return max(min_nodes, min(max_nodes, capacity // max(active_rows, 1)))


def cost_model_budget(expected_tokens: torch.Tensor, profile: HardwareProfile, active_rows: int,
                      min_nodes: int, max_nodes: int, drafting_s: Sequence[float] | None = None,
                      slack: float = 1.0, min_gain: float = 0.0) -> int:
    """argmax_N  sum_b E[tokens_b | N] / (T(B, N) + drafting time for N), or with slack < 1 the
    largest N whose rate is within that factor of the best;
    expected_tokens [B, K] for N = 1..K (N is capped at K and max_nodes);
    drafting_s[N - 1]: seconds to draft a tree of N nodes (None: drafting is free);
    min_gain: a tree must beat plain decoding's rate by this fraction to be chosen."""
    total = expected_tokens.sum(dim=0).tolist()  # one host sync, not one per N
    rates = {n: total[n - 1] / (profile.latency(active_rows, n) + drafting_time(drafting_s, n))
             for n in range(min_nodes, min(max_nodes, len(total)) + 1)}
    if 1 in rates:
        rates[1] *= 1 + min_gain
    best = max(rates.values())
    return max(n for n, rate in rates.items() if rate >= slack * best)


def speculation_may_pay(profile: HardwareProfile, active_rows: int, max_nodes: int, max_depth: int,
                        drafting_s: Sequence[float] | None = None) -> bool:
    """Whether some N > 1 could beat plain decoding even if every draft on a chain were accepted
    (N nodes emit at most min(N, depth + 1) tokens). If not, the step need not draft at all."""
    plain_rate = 1.0 / profile.latency(active_rows, 1)
    return any(min(n, max_depth + 1) / (profile.latency(active_rows, n) + drafting_time(drafting_s, n)) > plain_rate
               for n in range(2, max_nodes + 1))


def drafting_time(drafting_s: Sequence[float] | None, nodes: int) -> float:
    return 0.0 if drafting_s is None or nodes == 1 else drafting_s[nodes - 1]
