"""What the hardware allows a decode step: the weight-read floor and the matmul floor.

A batch-1 step must read every weight once (bytes / memory bandwidth); a large-batch step
must do its multiply-adds (FLOPs / the best measured matmul throughput). Measured ratios to
these floors say how much of a step is overhead.
"""
from __future__ import annotations

import time

import torch

from ..models import synchronize


def best_seconds(fn, device: torch.device, repeats: int) -> float:
    fn()  # first touch: page faults and kernel selection are not throughput
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


def memory_bandwidth_gbs(device: torch.device, megabytes: int = 512, repeats: int = 5) -> float:
    """Best-of-`repeats` copy bandwidth in GB/s, counting the bytes read and the bytes written."""
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / best_seconds(lambda: dst.copy_(src), device, repeats) / 1e9


def matmul_gflops(device: torch.device, dtype: torch.dtype = torch.float32, size: int = 2048, repeats: int = 5) -> float:
    """Best-of-`repeats` throughput of a square matmul, in GFLOP/s."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return 2 * size**3 / best_seconds(lambda: a @ b, device, repeats) / 1e9


def weight_bytes_per_step(model) -> int:
    """Bytes a batch-1 decode step must read: every distinct parameter once.

    A tied embedding matrix is counted once: the LM head GEMV reads all of it, the input
    lookup one row. An untied input embedding is left out (the lookup reads one row of it).
    """
    tied = model.lm_head.weight is model.embed_tokens.weight
    return sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()  # shared parameters are listed once
        if tied or name != "embed_tokens.weight"
    )


def decode_step_flops(model, rows: float, context: float) -> float:
    """Multiply-add FLOPs of one decode step of `rows` tokens attending to `context` slots:
    every linear layer (the LM head included) and the attention scores and sums."""
    cfg = model.config
    linear = sum(p.numel() for name, p in model.named_parameters() if name.endswith("proj.weight"))
    linear += model.lm_head.weight.numel()
    attention = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context
    return 2 * rows * (linear + attention)
