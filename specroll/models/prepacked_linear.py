"""A linear layer that, for CPU inference, multiplies by a oneDNN-prepacked copy of its weight.

Why: on CPU, `F.linear` hands a matrix of a few rows to an sgemm that repacks the whole
weight on every call. Measured with torch 2.13 on a 2-core AVX2 EPYC, the SmolLM2 LM head
(49152 x 576) took 17 ms for 1 row but 44 ms for 8 rows; with the weight packed once into
oneDNN's blocked layout, 11 ms and 15 ms. A verify pass over a draft tree is exactly such a
few-row product, so without this a tree costs several plain steps and speculation cannot
pay on CPU. GPUs (and training, which needs gradients) keep `F.linear`.

The packed copy is rebuilt whenever the weight changes (another tensor, or an in-place update
such as `load_state_dict` during weight sync), so it can never serve stale weights.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN picks the blocked layout for an expected row count; 16 (a tree's worth of nodes)
# measured as fast as a per-size layout from 1 to 1024 rows.
PACKING_ROWS_HINT = 16


class PackedWeight:
    """A oneDNN-packed copy of a weight, rebuilt whenever the tensors it derives from change:
    a different tensor (by identity, held weakly so a freed one is never mistaken for a new
    one at the same address) or an in-place update (version counter)."""

    def __init__(self) -> None:
        self.sources: tuple = ()  # (weakref, version) per source tensor
        self.packed: torch.Tensor | None = None

    def get(self, sources: tuple[torch.Tensor, ...], make_weight) -> torch.Tensor | None:
        """The packed `make_weight()`; None where packing is impossible (then use F.linear)."""
        if any(t.is_inference() for t in sources):
            return None  # inference tensors have no version counter to detect updates by
        fresh = len(self.sources) == len(sources) and all(
            ref() is t and version == t._version for (ref, version), t in zip(self.sources, sources))
        if not fresh:
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(make_weight().detach(), PACKING_ROWS_HINT)
            except (RuntimeError, AttributeError):
                self.packed = None  # e.g. bf16 on a CPU without bf16 instructions
            self.sources = tuple((weakref.ref(t), t._version) for t in sources)
        return self.packed

    # A cache: copies and pickles (deepcopy of heads, Ray transfers) start empty and repack on
    # first use; oneDNN's packed tensors cannot be copied or pickled anyway.
    def __deepcopy__(self, memo) -> "PackedWeight":
        return PackedWeight()

    def __getstate__(self) -> dict:
        return {"sources": (), "packed": None}


def uses_packed_weight(x: torch.Tensor) -> bool:
    """Packed weights serve eager CPU inference; training (autograd), GPUs and compiled steps
    (inductor cannot take oneDNN-layout inputs) use F.linear."""
    return x.device.type == "cpu" and not torch.is_grad_enabled() and not torch.compiler.is_compiling()


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def set_prepacked(module: nn.Module, enabled: bool) -> None:
    """Switch every `PrepackedLinear` inside `module`."""
    for child in module.modules():
        if isinstance(child, PrepackedLinear):
            child.prepacked = enabled


class PrepackedLinear(nn.Linear):
    """`nn.Linear`; with `prepacked = True`, CPU forwards without autograd use a packed weight."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prepacked = False
        self._packed = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prepacked and uses_packed_weight(x):
            packed = self._packed.get((self.weight,), lambda: self.weight)
            if packed is not None:
                return packed_linear(x, packed, self.bias)
        return F.linear(x, self.weight, self.bias)
