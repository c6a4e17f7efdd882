"""A linear layer that, for CPU inference, multiplies by a oneDNN-prepacked copy of its weight.

Why: on CPU, `F.linear` hands a matrix of a few rows to an sgemm that repacks the whole
weight on every call. Measured with torch 2.13 on a 2-core AVX2 EPYC, the SmolLM2 LM head
(49152 x 576) took 17 ms for 1 row but 44 ms for 8 rows; with the weight packed once into
oneDNN's blocked layout, 11 ms and 15 ms. A verify pass over a draft tree is exactly such a
few-row product, so without this a tree costs several plain steps and speculation cannot
pay on CPU. GPUs (and training, which needs gradients) keep `F.linear`.

The packed copy is rebuilt whenever the weight changes (new storage or an in-place update,
e.g. `load_state_dict` during weight sync), so it can never serve stale weights.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN picks the blocked layout for an expected row count; 16 (a tree's worth of nodes)
# measured as fast as a per-size layout from 1 to 1024 rows.
PACKING_ROWS_HINT = 16


class PrepackedLinear(nn.Linear):
    """`nn.Linear`; with `prepacked = True`, CPU forwards without autograd use a packed weight."""

    prepacked = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prepacked and x.device.type == "cpu" and not torch.is_grad_enabled():
            packed = self._packed_weight()
            if packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _packed_weight(self) -> torch.Tensor | None:
        weight = self.weight
        if weight.is_inference():
            return None  # inference tensors have no version counter to detect updates by
        key = (weight.data_ptr(), weight._version, weight.dtype)
        if getattr(self, "_packed_key", None) != key:
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_ROWS_HINT)
            except (RuntimeError, AttributeError):
                self._packed = None  # e.g. bf16 on a CPU without bf16 instructions: plain F.linear
            self._packed_key = key
        return self._packed
