"""A model's weights cut into fixed-size byte buckets: what a collective weight sync streams, one at a time.

A bucket is one flat byte buffer holding whole tensors, floating-point ones in the receivers' dtype,
each aligned as in `flat_weights` (so every slot is a view of any dtype); a tensor larger than a
bucket goes alone. Sender and receivers share the plan, so only bytes travel, and memory on either
side is one bucket, never the whole model. Tied tensors (one tensor under several names) go once.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .flat_weights import TensorSlot, aligned, dtype_name, view


@dataclass(frozen=True)
class Bucket:
    """Whole tensors in one byte buffer: `slots`' offsets are into it."""

    slots: tuple[TensorSlot, ...]
    nbytes: int

    @property
    def names(self) -> list[str]:
        """The first name of each tensor: the one to read it by."""
        return [slot.names[0] for slot in self.slots]


@dataclass(frozen=True)
class BucketPlan:
    """Every tensor of a model, in state-dict order, cut into buckets of at most `bucket_bytes` (one tensor may exceed it)."""

    buckets: tuple[Bucket, ...]

    @classmethod
    def of(cls, module: nn.Module, dtype: torch.dtype | None, bucket_bytes: int) -> "BucketPlan":
        """`module`'s plan with floating-point tensors as `dtype` (None keeps theirs).

        Shapes are the full ones even where ZeRO-3 has partitioned a parameter (`ds_shape`); tied
        names are found by tensor identity, since partitioned tensors share an empty storage.
        """
        buckets: list[Bucket] = []
        slots: list[TensorSlot] = []
        used = 0
        for names, tensor in distinct_tensors(module):
            target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            shape = tuple(getattr(tensor, "ds_shape", tensor.shape))
            size = aligned(max(1, torch.Size(shape).numel()) * target.itemsize)
            if slots and used + size > bucket_bytes:
                buckets.append(Bucket(tuple(slots), used))
                slots, used = [], 0
            slots.append(TensorSlot(names, dtype_name(target), shape, used))
            used += size
        if slots:
            buckets.append(Bucket(tuple(slots), used))
        return cls(tuple(buckets))

    @property
    def nbytes(self) -> int:
        return sum(bucket.nbytes for bucket in self.buckets)

    @property
    def largest(self) -> int:
        """The bytes of the largest bucket: the buffer each side holds."""
        return max((bucket.nbytes for bucket in self.buckets), default=0)

    def check(self, module: nn.Module) -> None:
        """Raise ValueError unless the plan's names and shapes are exactly `module`'s state dict."""
        targets = module.state_dict()
        planned = {name: slot.shape for bucket in self.buckets for slot in bucket.slots for name in slot.names}
        if set(targets) != set(planned):
            missing, unexpected = sorted(set(targets) - set(planned)), sorted(set(planned) - set(targets))
            raise ValueError(f"weights do not match the model: missing {missing}, unexpected {unexpected}")
        for name, shape in planned.items():
            if tuple(targets[name].shape) != shape:
                raise ValueError(f"weight {name} has shape {list(shape)}, the model's is {list(targets[name].shape)}")


def distinct_tensors(module: nn.Module) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    """`module`'s state-dict tensors (parameters as themselves, not their data) with all the names each goes by."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
        tensors.setdefault(id(tensor), tensor)
    return [(tuple(names[key]), tensors[key]) for key in names]


@torch.no_grad()
def pack_bucket(bucket: Bucket, tensors: Mapping[str, torch.Tensor], buffer: torch.Tensor) -> torch.Tensor:
    """`bucket`'s tensors (by first name, any device and dtype) copied into the start of `buffer`
    (uint8, at least `bucket.nbytes`), converted to their slots' dtypes; returns that part of it."""
    flat = buffer[: bucket.nbytes]
    for slot in bucket.slots:
        view(flat, slot).copy_(tensors[slot.names[0]])
    return flat


@torch.no_grad()
def unpack_bucket(bucket: Bucket, flat: torch.Tensor, targets: Mapping[str, torch.Tensor]) -> None:
    """Copy `bucket`'s tensors out of its bytes `flat` into `targets` (a state dict: cast to each
    target's dtype and device); a tied target, written through its first name, is not written twice."""
    for slot in bucket.slots:
        first = targets[slot.names[0]]
        source = view(flat, slot)
        first.copy_(source)
        for name in slot.names[1:]:
            if targets[name].data_ptr() != first.data_ptr():
                targets[name].copy_(source)

