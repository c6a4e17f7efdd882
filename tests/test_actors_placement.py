"""Placement on a cluster of GPU nodes, shown with `ray.cluster_utils.Cluster` nodes that declare
GPUs as resources (no GPU needed to schedule; the devices still come from the config: cpu):
the learner's ranks packed on one node where they fit (else on as few as they fit), the rollout
actors spread, rank 0 listening at its node's address on a port of `cluster.master_port_range`,
and a learner of 2 ranks on 2 nodes training with the weights streamed in buckets, and resuming
after a rollout actor dies during a sync."""
import json
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import ray
from hydra import compose, initialize_config_dir
from ray.cluster_utils import Cluster

from specroll.actors import ActorFailedError, RunActors
from specroll.actors.placement import bundle, fits_one_node, learner_strategy, reserve
from specroll.actors.rendezvous import free_port_in
from specroll.configs import load_train_config
from specroll.train import WEIGHT_SYNC, run_training

CONF = Path(__file__).resolve().parents[1] / "conf"
PORTS = [29650, 29659]
PORT_RANGE_RULE = "cluster.master_port_range must be [low, high], ports in [1024, 65535] with low <= high, got "
ON_CPU = ["model.device=cpu", "learner.device=cpu", "cluster.phase_threads=false",
          f"cluster.master_port_range=[{PORTS[0]},{PORTS[1]}]"]


def config(run_dir, overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return load_train_config(compose("config", overrides=["experiment=smoke", f"run_dir={run_dir}",
                                                              "logger.console=false", *ON_CPU, *overrides]))


def test_a_bundle_holds_only_what_an_actor_reserves():
    assert bundle(4.0, 1.0, {"rollout": 1.0}) == {"CPU": 4.0, "GPU": 1.0, "rollout": 1.0}
    assert bundle(1.0, 0.0, {}) == {"CPU": 1.0}  # Ray refuses a zero amount


def test_the_learner_is_strictly_packed_where_one_node_holds_all_its_ranks_else_packed():
    four_ranks = [{"CPU": 4.0, "GPU": 1.0}] * 4
    eight_gpu_node, two_gpu_node = {"CPU": 96.0, "GPU": 8.0}, {"CPU": 96.0, "GPU": 2.0}
    assert fits_one_node(four_ranks, [two_gpu_node, eight_gpu_node])
    assert learner_strategy(four_ranks, [two_gpu_node, eight_gpu_node]) == "STRICT_PACK"
    assert learner_strategy(four_ranks, [two_gpu_node, two_gpu_node]) == "PACK"  # 2 + 2 GPUs: two nodes
    assert learner_strategy(four_ranks, [{"CPU": 8.0, "GPU": 8.0}]) == "PACK"  # 16 CPUs asked, 8 offered
    with_resource = [{"CPU": 1.0, "learner": 1.0}] * 2
    assert learner_strategy(with_resource, [{"CPU": 8.0}, {"CPU": 8.0, "learner": 2.0}]) == "STRICT_PACK"
    assert learner_strategy(with_resource, [{"CPU": 8.0, "learner": 1.0}] * 2) == "PACK"


def test_a_port_is_taken_from_the_range_and_a_busy_range_is_named():
    assert all(PORTS[0] <= free_port_in(PORTS) <= PORTS[1] for _ in range(5))
    assert free_port_in((PORTS[0], PORTS[0] + 1), avoid={PORTS[0]}) == PORTS[0] + 1
    with socket.socket() as busy:
        busy.bind(("", PORTS[0]))
        busy.listen()
        with pytest.raises(RuntimeError, match=rf"no free port in cluster.master_port_range \[{PORTS[0]}, {PORTS[0]}\]"):
            free_port_in((PORTS[0], PORTS[0]))


@pytest.mark.parametrize("ports, message", [
    ("[29500]", f"{PORT_RANGE_RULE}[29500]"),
    ("[80,90]", f"{PORT_RANGE_RULE}[80, 90]"),
    ("[29600,29500]", f"{PORT_RANGE_RULE}[29600, 29500]"),
])
def test_an_invalid_port_range_is_named(tmp_path, ports, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        config(tmp_path, [f"cluster.master_port_range={ports}"])


def gpu_cluster(nodes: int, gpus_per_node: int) -> Cluster:
    """A head without CPUs (as in launch/cluster_gpu.yaml) and `nodes` nodes declaring 2 CPUs and `gpus_per_node` GPUs."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 200 * 2**20,
                                                            "include_dashboard": False})
    for _ in range(nodes):
        cluster.add_node(num_cpus=2, num_gpus=gpus_per_node, object_store_memory=200 * 2**20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    return cluster


def stop(cluster: Cluster) -> None:
    ray.shutdown()
    cluster.shutdown()


def node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def rendezvous_of(actor) -> tuple[str, int]:
    """The MASTER_ADDR / MASTER_PORT a learner rank joined its process group at."""
    return ray.get(actor.__ray_call__.remote(lambda self: (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))))


def node_addresses() -> dict[str, str]:
    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}


@pytest.mark.ray
def test_the_learner_ranks_share_a_node_and_the_rollout_actors_spread(tmp_path):
    cluster = gpu_cluster(nodes=3, gpus_per_node=2)
    try:
        cfg = config(tmp_path, ["cluster.learner_world_size=2", "cluster.gpus_per_learner=1",
                                "cluster.num_rollout_actors=2", "cluster.gpus_per_rollout_actor=1",
                                "cluster.cpus_per_rollout_actor=1", "cluster.cpus_per_learner=1"])
        actors = RunActors.start(cfg)
        try:
            learners = [node_of(a) for a in actors.learners]
            rollout = [node_of(a) for a in actors.rollout]
            rendezvous = [rendezvous_of(a) for a in actors.learners]
            addresses = node_addresses()
        finally:
            actors.shutdown()
    finally:
        stop(cluster)
    assert learners[0] == learners[1], "the learner's ranks fit one node, so they share it"
    assert rollout[0] != rollout[1], "the rollout actors spread over the nodes"
    host, port = rendezvous[0]
    assert rendezvous[1] == rendezvous[0] and host == addresses[learners[0]] and PORTS[0] <= port <= PORTS[1]


def pid_of(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


def written_bytes(pid: int) -> int:
    return int(next(line.split()[1] for line in Path(f"/proc/{pid}/io").read_text().splitlines()
                    if line.startswith("wchar:")))


@pytest.mark.ray
def test_a_learner_of_two_ranks_on_two_nodes_trains_and_resumes_after_a_rollout_actor_dies_mid_sync(tmp_path):
    """Issue 65's acceptance run: 2 learner ranks on 2 nodes, weights streamed in 1 MiB buckets over
    the collective to 2 rollout actors, rollout actor 0 stopped at step 1's sync and killed once learner
    rank 0 has streamed a MiB of it (to the other)."""
    cluster = gpu_cluster(nodes=2, gpus_per_node=1)
    overrides = ["cluster.learner_world_size=2", "cluster.gpus_per_learner=1", "cluster.cpus_per_learner=1",
                 "cluster.cpus_per_rollout_actor=1", "rollout=vanilla", "total_steps=3", "checkpoint_every=1",
                 "cluster.num_rollout_actors=2", "cluster.weight_sync=collective", "cluster.weight_sync_bucket_mb=1"]
    placed, streamed = {}, []

    def look_then_kill_during_sync(step, phase, actors):
        if phase != WEIGHT_SYNC:
            return
        nodes = [node_of(a) for a in actors.learners]
        placed[step] = (nodes, rendezvous_of(actors.learners[1]), node_addresses()[nodes[0]])
        if step != 1:
            return
        victim, sender = pid_of(actors.rollout[0]), pid_of(actors.learners[0])
        before = written_bytes(sender)
        os.kill(victim, signal.SIGSTOP)  # the sync cannot finish without it

        def kill_once_streaming():
            deadline = time.monotonic() + 60
            while written_bytes(sender) - before < 2**20 and time.monotonic() < deadline:
                time.sleep(0.01)
            streamed.append(written_bytes(sender) - before)
            os.kill(victim, signal.SIGKILL)

        threading.Thread(target=kill_once_streaming, daemon=True).start()

    try:
        with pytest.raises(ActorFailedError, match=r"rollout actor 0 died during sync_policy \(policy version 1\)"):
            run_training(config(tmp_path, overrides), on_phase=look_then_kill_during_sync)
        summary = run_training(config(tmp_path, overrides))  # resume=auto
    finally:
        stop(cluster)
    nodes, (host, port), rank_0_address = placed[0]
    assert nodes[0] != nodes[1], "one GPU per node: the ranks are on two nodes"
    assert host == rank_0_address and PORTS[0] <= port <= PORTS[1]
    assert streamed[0] >= 2**20, "the sync was under way when the rollout actor died"
    assert (summary.first_step, summary.policy_version) == (1, 3)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["train/num_sequences"] == 4 for r in rows)  # both ranks' shares


@pytest.mark.ray
def test_a_cluster_that_cannot_offer_the_bundles_is_named_with_what_it_offers(tmp_path):
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        cfg = config(tmp_path, ["cluster.learner_world_size=2", "cluster.remote_timeout_s=3"])
        with pytest.raises(ActorFailedError) as failed:
            reserve(cfg.cluster, cfg.cluster.remote_timeout_s)
        assert ray.util.placement_group_table() == {} or all(
            g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())
    finally:
        ray.shutdown()
    message = str(failed.value)
    assert message.startswith("the Ray cluster did not offer, within 3 s (cluster.remote_timeout_s), the learner's "
                              "2 x {'CPU': 1.0} (PACK)"), message
    assert "its nodes offer: CPU=1" in message
