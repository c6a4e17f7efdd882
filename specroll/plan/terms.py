"""The memory terms of a run, in bytes, as pure functions of shapes and settings.

Every count follows what our code allocates (`models/llama.py`, `learner/logprobs.py`,
`models/kv_cache.py`); the model states follow DeepSpeed's own estimators
(`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`, no offload).
"""
from __future__ import annotations

from typing import NamedTuple

from .architecture import ModelShape

FP32 = 4  # bytes: master weights, Adam moments, the log-softmax's logits
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SPAN_BUCKET = 64
# DeepSpeed's defaults (elements), which our DeepSpeed config keeps: reduce_bucket_size (ZeRO) and
# allreduce_bucket_size (ZeRO-0), stage3_prefetch_bucket_size
REDUCE_BUCKET = 500_000_000
PREFETCH_BUCKET = 50_000_000  # rollout.decode_state.SPAN_BUCKET: cache slots come in multiples of it


class ModelStates(NamedTuple):
    """A learner rank's share of the policy's training state, bytes."""

    weights: float
    gradients: float
    optimizer: float  # float32 master weights (mixed precision) and AdamW's two moments


def model_states(params: int, largest_module: int, zero_stage: int, world: int, dtype_bytes: int) -> ModelStates:
    """One rank's weights, gradients and optimizer states under ZeRO `zero_stage` over `world` ranks.

    Mixed precision (16-bit weights) keeps float32 master weights, float32 gradients and AdamW's
    two float32 moments besides the 16-bit weights and gradients; stage 1 shards the optimizer
    states and float32 gradients, 2 also the 16-bit gradients, 3 also the weights (ZeRO-3 holds the
    module it gathers, weights and gradients, whole). In float32 the weights are the master copy.
    """
    b, p, largest = dtype_bytes, params, largest_module
    sharded = world if zero_stage >= 1 else 1
    mixed = b != FP32
    gathered = b * largest if zero_stage == 3 else 0
    weights = (b * p / world if zero_stage == 3 else b * p) + gathered
    own_grads = b * p / world if zero_stage >= 2 else b * p  # gradients in the training dtype
    if mixed and zero_stage == 3:
        gradients = FP32 * p / world + gathered  # DeepSpeed accumulates ZeRO-3 partitions in float32
    elif mixed:
        gradients = own_grads + FP32 * p / sharded
    else:
        gradients = own_grads + gathered
    optimizer = (3 if mixed else 2) * FP32 * p / sharded
    return ModelStates(weights, gradients, optimizer)


def zero_buffers(params: int, zero_stage: int, world: int, dtype_bytes: int) -> float:
    """DeepSpeed's gradient bucket (ZeRO-1/2's contiguous gradient buffer, ZeRO-0's all-reduce
    bucket across ranks) and ZeRO-3's prefetch bucket; none for one ZeRO-0 rank, which the
    learner runs without an all-reduce."""
    if zero_stage == 0 and world == 1:
        return 0.0
    prefetch = min(params, PREFETCH_BUCKET) if zero_stage == 3 else 0
    return (min(params, REDUCE_BUCKET) + prefetch) * dtype_bytes


def norm_saved_per_token(shape: ModelShape, b: int) -> int:
    """RMSNorm keeps its float32 input, the normalised value and its output for backward."""
    return (FP32 + 2 * b) * shape.hidden


def layer_saved_per_token(shape: ModelShape, b: int) -> int:
    """Bytes one decoder layer keeps for backward per token, without checkpointing: two norms;
    the q/k/v output, the rotated halves and rotated q, k, the attention output and its
    transposed copy (flash / memory-efficient attention: no score matrix, a float32 log-sum-exp
    per head), and the query and key norms' (as a norm's) where the model has them; gate/up,
    SiLU(gate) and their product."""
    q, kv = shape.q_width, shape.kv_width
    attention = b * (5 * q + 4 * kv) + FP32 * shape.heads + (FP32 + 2 * b) * (q + kv) * shape.qk_norm
    mlp = 4 * b * shape.intermediate
    return 2 * norm_saved_per_token(shape, b) + attention + mlp


def layer_backward_per_token(shape: ModelShape, b: int) -> int:
    """Gradients alive inside one layer's backward: those of gate/up, its product and the
    residual stream (the widest moment, at the MLP)."""
    return b * (3 * shape.intermediate + 2 * shape.hidden)


def activations(shape: ModelShape, tokens: int, b: int, checkpointing: bool) -> float:
    """Activations a micro-batch of `tokens` padded tokens keeps from its forward to its backward:
    every layer's intermediates, or with checkpointing only each layer's two inputs (residual
    stream and pending update); and the final norm's."""
    kept = shape.layers * (2 * shape.hidden * b if checkpointing else layer_saved_per_token(shape, b))
    return tokens * (kept + norm_saved_per_token(shape, b))


def layer_backward(shape: ModelShape, tokens: int, b: int, checkpointing: bool) -> float:
    """What one layer's backward adds at a time: its gradients, and with checkpointing its
    recomputed intermediates. The logits are gone by then, so the two never add up."""
    recomputed = layer_saved_per_token(shape, b) if checkpointing else 0
    return tokens * (recomputed + layer_backward_per_token(shape, b))


def logits(positions: int, vocab: int, b: int) -> float:
    """The LM head's logits at `positions` and their gradient, at the widest moment.

    Forward: the logits in the training dtype, their float32 copy that `TokenLogprobs` keeps, and
    the float32 probabilities of the entropy. Backward: the kept float32 logits, the float32
    gradient built from them and its cast to the training dtype (no cast in float32)."""
    cast = b if b != FP32 else 0
    return positions * vocab * (2 * FP32 + cast)


def cache_shape(rows: int, need: int) -> tuple[int, int]:
    """(rows, slots) a KV cache allocates for `rows` rows of up to `need` tokens
    (`rollout.decode_state.cache_shape`: one spare row, one slot past the span bucket)."""
    return rows + 1, -(-need // SPAN_BUCKET) * SPAN_BUCKET + 1


def kv_cache(shape: ModelShape, rows: int, slots: int, b: int) -> float:
    """Keys and values of every layer for `rows` x `slots`."""
    return 2 * shape.layers * rows * slots * shape.kv_width * b


def decode_step(shape: ModelShape, rows: int, width: int, slots: int, b: int) -> float:
    """A decode step's widest buffers: the logits of `width` tokens per row (model dtype, then float32
    log-probabilities and probabilities) and the attention bias over `slots` per query head group."""
    groups = shape.heads // shape.kv_heads
    return rows * width * (shape.vocab * (b + 2 * FP32) + groups * slots * b)


def prefill(shape: ModelShape, prompts: int, prompt_len: int, slots: int, b: int) -> float:
    """Prefilling `prompts` prompts of up to `prompt_len` tokens at once: one layer's MLP
    intermediates (gate/up, SiLU, product), the residual stream and the attention bias and mask
    over `slots` (per query group)."""
    tokens = prompts * prompt_len
    groups = shape.heads // shape.kv_heads
    return tokens * (4 * b * shape.intermediate + 3 * b * shape.hidden + slots * (groups * b + 3))


def draft_heads(shape: ModelShape, num_heads: int, path_heads: bool, b: int) -> float:
    """Horizon heads: one linear (weight and bias) per head, from the hidden state (medusa) or
    the hidden state and the path token's embedding (path)."""
    inputs = 2 * shape.hidden if path_heads else shape.hidden
    return num_heads * (inputs + 1) * shape.hidden * b


def head_update(shape: ModelShape, num_heads: int, records: int) -> float:
    """A slow-path head update's widest buffers: float32 logits of every head for a batch of
    `records`, their log-softmax and gradient."""
    return 3 * FP32 * records * num_heads * shape.vocab
