"""launch/cluster_gpu.yaml: GPU workers with 80 GB per GPU (what the presets and the planner assume),
NCCL configured on them, and every value the user must fill in named in its header."""
import re
from pathlib import Path

import yaml

CLUSTER_FILE = Path(__file__).resolve().parents[1] / "launch" / "cluster_gpu.yaml"
# AWS 8-GPU instance types by memory per GPU.
GPU_MEMORY_GB = {"p4d.24xlarge": 40, "p3.16xlarge": 16, "p3dn.24xlarge": 32, "g5.48xlarge": 24,
                 "p4de.24xlarge": 80, "p5.48xlarge": 80, "p5e.48xlarge": 141, "p5en.48xlarge": 141}
NCCL_SETTINGS = ("NCCL_DEBUG", "NCCL_SOCKET_IFNAME")


def cluster():
    return yaml.safe_load(CLUSTER_FILE.read_text())


def worker_types(config):
    return {name: t for name, t in config["available_node_types"].items() if name != config["head_node_type"]}


def test_every_gpu_worker_has_80_gb_per_gpu():
    workers = worker_types(cluster())
    assert workers
    for name, node_type in workers.items():
        instance = node_type["node_config"]["InstanceType"]
        assert instance in GPU_MEMORY_GB, f"{name}: unknown instance type {instance}"
        assert GPU_MEMORY_GB[instance] >= 80, f"{name}: {instance} has {GPU_MEMORY_GB[instance]} GB per GPU"


def test_the_workers_set_nccl_and_enough_shared_memory():
    docker = cluster()["docker"]
    options = docker.get("run_options", []) + docker.get("worker_run_options", [])
    env = dict(re.fullmatch(r"-e (\w+)=(\S+)", o).groups() for o in options if o.startswith("-e "))
    for name in NCCL_SETTINGS:
        assert env.get(name), f"{name} is not set for the workers' containers"
    assert env["NCCL_DEBUG"] == "WARN"
    shm = [int(m.group(1)) for o in options if (m := re.fullmatch(r"--shm-size=(\d+)g", o))]
    assert shm and shm[-1] >= 64, "the workers' /dev/shm must hold a whole model in the object store"


def test_the_machine_image_is_pinned_and_each_placeholder_is_explained_in_the_header():
    config, text = cluster(), CLUSTER_FILE.read_text()
    for node_type in worker_types(config).values():
        assert "ImageId" in node_type["node_config"], "the GPU workers' machine image (and its driver) is not pinned"
    header = text[:text.index("cluster_name:")]
    body = text[len(header):]
    placeholders = set(re.findall(r"<[a-z0-9-]+>", body))
    assert placeholders and "<gpu-ami-id>" in placeholders
    unexplained = sorted(p for p in placeholders if p not in header)
    assert unexplained == [], f"placeholders the header does not tell the user to fill in: {unexplained}"
