"""Where the learner's collectives put their tensors, and that every collective of ours goes
through `specroll/learner/collectives.py` (the multi-rank path itself: test_learner_data_parallel.py)."""

from pathlib import Path

import pytest
import torch

import specroll
from specroll.learner.collectives import backend_for, device_for

COLLECTIVES = Path(specroll.__file__).parent / "learner" / "collectives.py"


@pytest.mark.parametrize(
    "backend, cuda_index, device",
    [("gloo", 0, torch.device("cpu")), ("gloo", 3, torch.device("cpu")),
     ("nccl", 0, torch.device("cuda", 0)), ("nccl", 3, torch.device("cuda", 3))],
)
def test_a_backend_takes_its_tensors_on_its_device(backend, cuda_index, device):
    assert device_for(backend, cuda_index) == device


@pytest.mark.parametrize("device", [torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 5)])
def test_the_backend_chosen_for_a_device_takes_tensors_of_that_kind(device):
    assert device_for(backend_for(device), device.index or 0).type == device.type


def test_an_unknown_backend_is_named():
    with pytest.raises(ValueError, match="'mpi'"):
        device_for("mpi", 0)


def test_only_the_collectives_module_uses_torch_distributed():
    sources = sorted(Path(specroll.__file__).parent.rglob("*.py"))
    users = [p for p in sources if p != COLLECTIVES and "torch.distributed" in p.read_text()]
    assert users == []
