"""A model's weights as one contiguous byte buffer per dtype plus an index: what a weight sync ships.

Ray stores numpy arrays out of band: `ray.put` copies each buffer into the shared-memory object
store once, and `ray.get` on the same node returns views of it, so a receiver reads the weights
without deserialising or copying them, and copies each straight into its own parameter.
Floating-point tensors are converted to the receiver's dtype while packing (once, by the sender).
Tied tensors (one tensor under several names) are packed once.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

ALIGN_BYTES = 64  # every tensor starts on a cache line, so views of any dtype are aligned


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lies: `names` share it (tied weights); `offset` is in bytes into `dtype`'s buffer."""

    names: tuple[str, ...]
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


@dataclass
class FlatWeights:
    """`buffers`: dtype name -> uint8 array [bytes]; `slots`: every tensor's place in them, in state-dict order."""

    buffers: dict[str, np.ndarray]
    slots: list[TensorSlot]

    @classmethod
    def pack(cls, state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None,
             into: "FlatWeights | None" = None) -> "FlatWeights":
        """`state`'s tensors (any device) copied into CPU buffers, floating-point ones as `dtype` (None keeps theirs).

        `into`: an earlier result for the same model and dtype whose buffers are overwritten and
        returned, sparing the page faults of fresh memory (they cost more than the copy itself).
        """
        slots, tensors, sizes = layout(state, dtype)
        reusable = into is not None and into.slots == slots and all(b.flags.writeable for b in into.buffers.values())
        if reusable:
            flat = {kind: torch.from_numpy(buffer) for kind, buffer in into.buffers.items()}
        else:
            flat = {kind: torch.empty(size, dtype=torch.uint8) for kind, size in sizes.items()}
        with torch.no_grad():
            for slot, tensor in zip(slots, tensors):
                view(flat[slot.dtype], slot).copy_(tensor)  # converts dtype and device in one pass
        return into if reusable else cls({kind: buffer.numpy() for kind, buffer in flat.items()}, slots)

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.buffers.values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every name's tensor as a view of the buffers (no copy; read-only when they come from Ray)."""
        with warnings.catch_warnings():
            # Ray's zero-copy arrays are read-only; these views are only ever read.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            flat = {kind: torch.from_numpy(buffer) for kind, buffer in self.buffers.items()}
        return {name: view(flat[slot.dtype], slot) for slot in self.slots for name in slot.names}

    def copy_into(self, module: nn.Module) -> None:
        """Overwrite `module`'s weights in place (cast to each parameter's dtype and device).

        The names and shapes must be exactly the module's state dict, as `load_state_dict(strict=True)` asks.
        """
        targets = module.state_dict()
        sources = self.tensors()
        if set(targets) != set(sources):
            missing, unexpected = sorted(set(targets) - set(sources)), sorted(set(sources) - set(targets))
            raise ValueError(f"weights do not match the model: missing {missing}, unexpected {unexpected}")
        for slot in self.slots:  # all checked before anything is overwritten
            for name in slot.names:
                if tuple(targets[name].shape) != slot.shape:
                    raise ValueError(f"weight {name} has shape {list(slot.shape)}, the model's is "
                                     f"{list(targets[name].shape)}")
        with torch.no_grad():
            for slot in self.slots:
                first = targets[slot.names[0]]
                first.copy_(sources[slot.names[0]])
                for name in slot.names[1:]:
                    if targets[name].data_ptr() != first.data_ptr():  # tied here too: already written
                        targets[name].copy_(sources[name])


def layout(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None
           ) -> tuple[list[TensorSlot], list[torch.Tensor], dict[str, int]]:
    """The slots of `state`'s distinct tensors (tied names share one), those tensors, and each buffer's size in bytes."""
    first_name: dict[tuple, int] = {}  # (address, dtype, shape, strides) -> index of the tensor
    names: list[list[str]] = []
    tensors: list[torch.Tensor] = []
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        if key in first_name:
            names[first_name[key]].append(name)
            continue
        first_name[key] = len(tensors)
        names.append([name])
        tensors.append(tensor)
    sizes: dict[str, int] = {}
    slots = []
    for tensor_names, tensor in zip(names, tensors):
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        kind = dtype_name(target)
        offset = sizes.get(kind, 0)
        slots.append(TensorSlot(tuple(tensor_names), kind, tuple(tensor.shape), offset))
        sizes[kind] = offset + aligned(tensor.numel() * target.itemsize)
    return slots, tensors, sizes


def view(flat: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """`slot`'s tensor inside the uint8 buffer `flat` of its dtype."""
    dtype = torch_dtype(slot.dtype)
    return flat[slot.offset: slot.offset + slot.numel * dtype.itemsize].view(dtype).view(slot.shape)
