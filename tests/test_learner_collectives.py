"""Where the learner's collectives put their tensors, and that every collective of ours goes
through `specroll/learner/collectives.py` (the multi-rank path itself: test_learner_data_parallel.py)."""

import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch

import specroll
from specroll.learner.collectives import backend_for, device_for, group_store

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


def test_a_groups_leader_listens_at_its_address_alone():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    leader = group_store("127.0.0.1", port, timedelta(seconds=10), 2, leader=True)
    member = group_store("127.0.0.1", port, timedelta(seconds=10), 2, leader=False)
    member.set("from", "member")
    assert leader.get("from") == b"member"
    listening = [c.laddr for c in psutil.Process().net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert [(a.ip, a.port) for a in listening] == [("127.0.0.1", port)]  # torch's own store: "::" too


def test_only_the_collectives_module_uses_torch_distributed():
    sources = sorted(Path(specroll.__file__).parent.rglob("*.py"))
    users = [p for p in sources if p != COLLECTIVES and "torch.distributed" in p.read_text()]
    assert users == []


RANK_SCRIPT = """
import os, sys, time
import torch
import torch.distributed as dist
from specroll.learner.collectives import ensure_distributed, sum_over_ranks
ensure_distributed(torch.device("cpu"), float(sys.argv[1]))
group = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
print("timeout_s", group.options._timeout.total_seconds(), flush=True)
if os.environ["RANK"] == "1":
    time.sleep(60)  # never joins rank 0's all-reduce
    sys.exit(0)
started = time.perf_counter()
try:
    sum_over_ranks([1.0])
except Exception:
    print("failed_after_s", time.perf_counter() - started, flush=True)
"""


def test_the_collective_timeout_reaches_the_learners_process_group(tmp_path):
    """learner.collective_timeout_s: the group is built with it, and a collective that a rank never
    joins fails after it (torch's default would wait 10 minutes, DeepSpeed's 30)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(specroll.__file__).parents[1]), "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LOCAL_RANK": "0"}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, "4"], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for r in (0, 1)]
    try:
        out, _ = ranks[0].communicate(timeout=120)
    finally:
        for rank in ranks:
            rank.kill()
    values = dict(line.split() for line in out.splitlines() if line.startswith(("timeout_s", "failed_after_s")))
    assert float(values["timeout_s"]) == 4.0
    assert 3.5 <= float(values["failed_after_s"]) < 30
