"""The learner's process group: joining it, and every collective of ours over it.

NCCL moves CUDA tensors only: a CPU tensor handed to it fails the step ("no backend type
associated with device type cpu"). So every collective here builds its tensors on
`collective_device()`, read from the group: the CPU under gloo, this rank's GPU under NCCL.

The group is gloo on CPU and NCCL on CUDA, not one serving both (`cpu:gloo,cuda:nccl`, which
torch and DeepSpeed accept): ours need one device each and DeepSpeed puts its own on the
accelerator; a gloo half would connect every rank to every other at start, over the interface its
host name resolves to unless GLOO_SOCKET_IFNAME says otherwise (one more network setting to get
right per cluster); and a misplaced tensor would pass through it slowly instead of failing.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def backend_for(device: torch.device) -> str:
    """The process-group backend whose collectives take `device`'s tensors."""
    return "gloo" if device.type == "cpu" else "nccl"


def device_for(backend: str, cuda_index: int) -> torch.device:
    """Where `backend`'s collectives take their tensors; `cuda_index` is this process's GPU."""
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl":
        return torch.device("cuda", cuda_index)
    raise ValueError(f"the learner's collectives run on a gloo or nccl process group, found {backend!r}")


def group_of_its_own(store: dist.Store, rank: int, size: int, backend: str, host: str,
                     timeout_s: float) -> dist.ProcessGroup:
    """A process group beside the process-wide one (which it neither needs nor touches), on `store`.

    Every collective over it fails after `timeout_s` rather than wait forever on a dead member.
    Gloo listens on `host`, this process's node address, not whatever its host name resolves to.
    """
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, size, options)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ValueError(f"a group of its own is gloo or nccl, found {backend!r}")


def collective_device() -> torch.device:
    """`device_for` the default group's backend and this process's current GPU."""
    # Reading the current GPU starts CUDA; a rank under NCCL has started it, a CPU rank must not.
    cuda_index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    return device_for(dist.get_backend(), cuda_index)


# The types a group of its own is built from, for modules that hold one (only this module imports torch.distributed).
Store, ProcessGroup = dist.Store, dist.ProcessGroup


def group_store(host: str, port: int, timeout: timedelta, world_size: int | None, leader: bool) -> dist.TCPStore:
    """A group's rendezvous store at `host:port`: the leader (rank 0) listens there, at `host` alone
    (torch's own store binds every interface, so a local run's group would be reachable from
    outside the machine); the other ranks connect to it."""
    if not leader:
        return dist.TCPStore(host, port, world_size, False, timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    # The store owns the socket from here on (detach: Python no longer closes it).
    return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())


def ensure_distributed(device: torch.device, timeout_s: float) -> None:
    """Join (or create) the process-wide process group: `backend_for(device)`, its collectives
    failing after `timeout_s` seconds (`learner.collective_timeout_s`).

    A plain `python` process gets one rank on an in-memory store; launchers (Ray actors,
    torchrun) set RANK / WORLD_SIZE / MASTER_* themselves.
    """
    os.environ.setdefault("DS_ACCELERATOR", device.type)
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator().device_name()
    if accelerator != device.type:
        raise ValueError(
            f"learner device is {device.type!r} but DeepSpeed's accelerator is {accelerator!r}; "
            f"set DS_ACCELERATOR={device.type} before deepspeed is first imported"
        )
    if device.type == "cpu" and "LOCAL_SIZE" not in os.environ:
        # DeepSpeed's shared-memory all-reduce serves only inference under its own launcher (LOCAL_SIZE), yet it
        # is compiled on first use: minutes, in a build directory that each Python environment rebuilds in turn.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if dist.is_initialized():
        return
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    backend, timeout = backend_for(device), timedelta(seconds=timeout_s)
    this_rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if size == 1:
        # One rank needs no rendezvous, so no port is picked that another process could take first.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    elif "MASTER_ADDR" in os.environ:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = group_store(host, port, timeout, size, leader=this_rank == 0)
        dist.init_process_group(backend, store=store, rank=this_rank, world_size=size, timeout=timeout)
    deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=timeout)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _all_reduce(values: list[float], op: dist.ReduceOp.RedOpType) -> list[float]:
    """`values` reduced elementwise over the ranks with `op`, in float64 on the group's device."""
    if world_size() == 1:
        return [float(v) for v in values]
    reduced = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.all_reduce(reduced, op=op)
    return reduced.tolist()


def sum_over_ranks(values: list[float]) -> list[float]:
    return _all_reduce(values, dist.ReduceOp.SUM)


def max_over_ranks(values: list[float]) -> list[float]:
    return _all_reduce(values, dist.ReduceOp.MAX)


def barrier() -> None:
    """Wait for every rank (no-op on one)."""
    if world_size() == 1:
        return
    device = collective_device()
    if device.type == "cuda":
        # Named, not guessed: NCCL's barrier would otherwise pick a GPU from the rank number.
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def objects_from_ranks(obj) -> list:
    """Every rank's picklable `obj`, indexed by rank (one item on one rank)."""
    if world_size() == 1:
        return [obj]
    gathered = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered
