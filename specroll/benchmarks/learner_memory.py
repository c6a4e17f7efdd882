"""One GRPO update step's peak memory against the planner's figure (`gpu_check --learner`).

The paper's 1.5B shape (random weights built from the shipped config.json), one process, plain
torch (no DeepSpeed: what a bare GPU machine has), activation checkpointing on, a micro-batch of
the paper preset's 16384 tokens (8 sequences of 2048, responses of 1024): two steps (forward with
the entropy, the GRPO loss's log-prob term, backward, fused AdamW), the second measured, with the
optimizer's moments alive as in every later step. On CUDA the peak is torch's allocator's
(`max_memory_allocated`); on a CPU the process's peak resident memory (VmHWM) since the first
step began, honest only when glibc maps every large allocation (`MALLOC_MMAP_THRESHOLD_=65536`;
otherwise its free lists inflate it).
"""
from __future__ import annotations

import os

import torch

from ..learner.logprobs import sequence_logprobs
from ..models import CausalLM, synchronize
from ..models.config import ModelArchitecture
from ..plan.architecture import ModelShape, shipped_architecture
from ..plan.planner import GIB, backward_peak
from ..plan.terms import DTYPE_BYTES, activations
from .process_memory import peak_resident_bytes, reset_peak, resident_bytes

PAPER_MODEL = "Qwen/Qwen2.5-1.5B-Instruct"
PAPER_BATCH = (8, 2048, 1024)  # rows, sequence length, response length: learner.micro_batch_tokens 16384
TINY_BATCH = (8, 512, 448)
MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"


def paper_config() -> ModelArchitecture:
    from transformers import AutoConfig

    return ModelArchitecture.from_hf(AutoConfig.from_pretrained(shipped_architecture(PAPER_MODEL)), name=PAPER_MODEL)


def planned_bytes(cfg: ModelArchitecture, dtype: str, rows: int, seq: int, resp: int, checkpointing: bool) -> dict:
    """The planner's single-rank terms for this step (plain AdamW: moments in the weights' dtype), bytes."""
    shape, b = ModelShape.of(cfg), DTYPE_BYTES[dtype]
    return {"weights": b * shape.params, "gradients": b * shape.params, "optimizer states": 2 * b * shape.params,
            "activations": activations(shape, rows * seq, b, checkpointing),
            "backward peak": backward_peak(shape, rows * seq, b, checkpointing, positions=rows * resp).bytes}


def memory_now(device: torch.device) -> int:
    """What the device holds now; on a CPU the peak starts again from here."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    reset_peak()
    return resident_bytes()


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return peak_resident_bytes()


def learner_step_memory(cfg: ModelArchitecture, dtype: str, device: torch.device, batch: tuple[int, int, int],
                        checkpointing: bool = True) -> dict:
    """Measured peak above the weights of the second of two update steps, against the planner's terms."""
    rows, seq, resp = batch
    torch.manual_seed(0)
    with torch.device(device):
        model = CausalLM(cfg)
    model.to(dtype=getattr(torch, dtype)).use_activation_checkpointing(checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (rows, seq), device=device)
    prompt_lens = torch.full((rows,), seq - resp, device=device)
    response_lens = torch.full((rows,), resp, device=device)
    advantages = torch.randn(rows, 1, device=device)

    def step() -> None:
        out = sequence_logprobs(model, ids, prompt_lens, response_lens, 1.0, with_entropy=True)
        # The policy-gradient term at ratio 1: the same graph and buffers as the clipped loss's.
        loss = -(advantages * out.logprobs * out.mask).sum() / out.mask.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradients stay allocated, as DeepSpeed's do

    before = memory_now(device)  # the weights
    step()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step()
    synchronize(device)
    measured = peak_memory(device) - before
    planned = planned_bytes(cfg, dtype, rows, seq, resp, checkpointing)
    predicted = sum(v for k, v in planned.items() if k != "weights")
    return {"model": cfg.name or "tiny", "dtype": dtype, "device": str(device), "rows": rows, "seq_len": seq,
            "response_len": resp, "activation_checkpointing": checkpointing,
            "measured_above_weights_gib": measured / GIB, "planned_above_weights_gib": predicted / GIB,
            "planned_over_measured": predicted / max(measured, 1),
            "planned_terms_gib": {k: v / GIB for k, v in planned.items()},
            "cpu_rss_honest": device.type == "cuda" or os.environ.get(MMAP_ENV) is not None}
