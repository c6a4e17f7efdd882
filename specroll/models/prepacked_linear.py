"""A linear layer that, for CPU inference, multiplies by a oneDNN-prepacked copy of its weight.

Why: on CPU, `F.linear` hands a matrix of a few rows to an sgemm that repacks the whole
weight on every call, so a product of a few rows costs several one-row products. A verify
pass over a draft tree is exactly such a few-row product: without a weight packed once, a
tree costs several plain steps and speculation cannot pay on CPU. GPUs (and training, which
needs gradients) keep `F.linear`.

The packed copy is rebuilt whenever the weight changes (another tensor, or an in-place update
such as `load_state_dict` during weight sync), so it can never serve stale weights. A compiled
step reaches it through the `specroll::prepacked_linear` op, which takes the plain weight and
looks its packed copy up: inductor cannot take oneDNN-layout tensors as inputs.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN picks the blocked layout for an expected row count; one for a tree's worth of nodes serves
# every row count as well as a layout per size would.
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
            # Versions read before packing: an update made meanwhile repacks at the next call.
            sources_now = tuple((weakref.ref(t), t._version) for t in sources)
            self.packed = pack(make_weight())
            self.sources = sources_now
        return self.packed

    # A cache: copies and pickles (deepcopy of heads, Ray transfers) start empty and repack on
    # first use; oneDNN's packed tensors cannot be copied or pickled anyway.
    def __deepcopy__(self, memo) -> "PackedWeight":
        return PackedWeight()

    def __getstate__(self) -> dict:
        return {"sources": (), "packed": None}


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` in oneDNN's blocked layout; None where it cannot be packed (then use F.linear)."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_ROWS_HINT)
    except (RuntimeError, AttributeError):
        return None  # e.g. bf16 on a CPU without bf16 instructions


def uses_packed_weight(x: torch.Tensor) -> bool:
    """Packed weights serve CPU inference; training (autograd) and GPUs use F.linear."""
    return x.device.type == "cpu" and not torch.is_grad_enabled()


try:
    _linear_pointwise = torch.ops.mkldnn._linear_pointwise.default
except AttributeError:  # torch built without oneDNN: nothing is ever packed, so never called
    _linear_pointwise = None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _linear_pointwise(x, packed, bias, "none", [], "")


# weight id -> (the weight's version when packed, its packed copy or None); an entry is
# dropped when its weight is freed, so an id never finds another tensor's copy.
_packed_by_weight: dict[int, tuple[int, torch.Tensor | None]] = {}


def packed_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy `linear_by_packed_copy` last made of `weight`, if any."""
    return _packed_by_weight.get(id(weight), (None, None))[1]


def repack(weight: torch.Tensor) -> torch.Tensor | None:
    if id(weight) not in _packed_by_weight:
        weakref.finalize(weight, _packed_by_weight.pop, id(weight), None)
    version = weight._version  # before packing: an update during it repacks at the next call
    packed = pack(weight)
    _packed_by_weight[id(weight)] = (version, packed)
    return packed


def linear_by_packed_copy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, multiplied by `weight`'s packed copy where it can be packed.

    The op's kernel, run over a hundred times a step, so where the copy is fresh it calls no
    Python function but the oneDNN op's: each Python frame costs time and, on Python 3.11-3.12,
    one that lands on a data-stack chunk boundary maps and unmaps it on every call (gh-142183)."""
    if weight.is_inference():
        return F.linear(x, weight, bias)  # no version counter to detect updates by
    version, packed = _packed_by_weight.get(id(weight), (None, None))
    if version != weight._version:
        packed = repack(weight)
    if packed is None:
        return F.linear(x, weight, bias)
    return _linear_pointwise(x, packed, bias, "none", [], "")


# `linear_by_packed_copy` as one op that inductor leaves alone, so compiled steps use packed
# weights too. Defined on a Library, not with `torch.library.custom_op`: a step makes over a
# hundred of these calls, and custom_op's Python wrapper adds to every one.
_library = torch.library.Library("specroll", "DEF")
_library.define("prepacked_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_library.impl("prepacked_linear", linear_by_packed_copy, "CPU")
prepacked_linear_op = torch.ops.specroll.prepacked_linear.default


@torch.library.register_fake("specroll::prepacked_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.prepacked and uses_packed_weight(x)):
            return F.linear(x, self.weight, self.bias)
        if not torch.compiler.is_compiling():
            return linear_by_packed_copy(x, self.weight, self.bias)
        if x.shape[:-1].numel() == 1:
            # One row: inductor turns this into one pass over the weight at memory speed, where
            # sgemm and oneDNN reach about half of it.
            out = (x[..., None, :] * self.weight).sum(-1)
            return out if self.bias is None else out + self.bias
        return prepacked_linear_op(x, self.weight, self.bias)
