"""Torch threads per actor follow the phase: hand-worked cases of the rule, and the threads actors
report on a real local Ray cluster."""
from pathlib import Path

import pytest
import ray
import torch
from hydra import compose, initialize_config_dir

from specroll.actors import RunActors
from specroll.actors.threads import PhaseThreads, node_cores, phase_threads
from specroll.configs import ClusterConfig, load_train_config
from specroll.data import load_problems

CONF = Path(__file__).resolve().parents[1] / "conf"


def cluster(**fields) -> ClusterConfig:
    return ClusterConfig(**fields)


def test_alternating_phases_give_the_active_side_the_whole_node():
    assert phase_threads(cluster(), cores=2) == PhaseThreads(rollout=2, learner=2)
    # 8 cores: three rollout actors take 8 // 3 = 2 each, two learner ranks 4 each.
    assert phase_threads(cluster(num_rollout_actors=3, learner_world_size=2), cores=8) == PhaseThreads(2, 4)
    # More actors than cores: one thread each, never zero.
    assert phase_threads(cluster(num_rollout_actors=4, cpus_per_rollout_actor=0.5), cores=2) == PhaseThreads(1, 2)


def test_without_phase_threads_each_actor_keeps_its_reserved_cpus():
    reserved = cluster(phase_threads=False, num_rollout_actors=2, cpus_per_rollout_actor=2.5, cpus_per_learner=0.5)
    assert phase_threads(reserved, cores=16) == PhaseThreads(2, 1)
    assert phase_threads(cluster(phase_threads=False, overlap=True), cores=16) == PhaseThreads(1, 1)


def test_overlapping_phases_split_the_node_by_reserved_cpus():
    assert phase_threads(cluster(overlap=True), cores=2) == PhaseThreads(1, 1)
    assert phase_threads(cluster(overlap=True), cores=8) == PhaseThreads(4, 4)
    # Rollouts reserve 2 x 1.5 = 3 CPUs, the learner 1: 8 * 3 / 4 = 6 cores for rollouts (3 each), 2 for the learner.
    two_rollouts = cluster(overlap=True, num_rollout_actors=2, cpus_per_rollout_actor=1.5)
    assert phase_threads(two_rollouts, cores=8) == PhaseThreads(3, 2)
    # 3 cores, equal reservations: 1.5 rounds half up to 2 for rollouts, the learner keeps 1.
    assert phase_threads(cluster(overlap=True), cores=3) == PhaseThreads(2, 1)
    # However lopsided the reservations, each side keeps a core.
    assert phase_threads(cluster(overlap=True, cpus_per_rollout_actor=10.0), cores=4) == PhaseThreads(3, 1)
    assert phase_threads(cluster(overlap=True), cores=1) == PhaseThreads(1, 1)


def test_gpu_actors_keep_their_reserved_cpus_and_a_cpu_side_alongside_gets_the_rest():
    gpu_rollouts = dict(num_rollout_actors=2, cpus_per_rollout_actor=4.0, gpus_per_rollout_actor=1.0)
    assert phase_threads(cluster(**gpu_rollouts), cores=16) == PhaseThreads(4, 16)
    assert phase_threads(cluster(**gpu_rollouts, overlap=True), cores=16) == PhaseThreads(4, 8)
    gpus_everywhere = cluster(**gpu_rollouts, gpus_per_learner=1.0, cpus_per_learner=2.5, overlap=True)
    assert phase_threads(gpus_everywhere, cores=16) == PhaseThreads(4, 2)
    gpu_learner = cluster(gpus_per_learner=1.0, cpus_per_learner=3.0, overlap=True)
    assert phase_threads(gpu_learner, cores=4) == PhaseThreads(1, 3)


RAY_CPUS = 2  # logical CPUs of this module's Ray cluster (conftest.ray_cluster)


def threads_of(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda _: torch.get_num_threads()), timeout=120)


@pytest.mark.parametrize("overrides", [
    ["cluster.num_rollout_actors=1"],
    ["cluster.num_rollout_actors=2", "cluster.cpus_per_rollout_actor=0.5", "cluster.overlap=true"],
], ids=["alternating", "overlapping"])
def test_actors_run_the_threads_of_their_phase(ray_cluster, overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = load_train_config(compose("config", overrides=["experiment=smoke", *overrides]))
    actors = RunActors.start(cfg)
    try:
        cores = ray.get(actors.learners[0].__ray_call__.remote(lambda _: node_cores()), timeout=120)
        expected = phase_threads(cfg.cluster, cores)
        # Until a phase starts each actor has its Ray reservation's threads.
        assert [threads_of(a) for a in actors.rollout] == [1] * cfg.cluster.num_rollout_actors
        assert threads_of(actors.learners[0]) == 1
        actors.sync_policy()
        problems = load_problems("synthetic", synthetic=cfg.data.synthetic)[:cfg.data.prompts_per_step]
        rollouts = actors.collect_rollouts(actors.start_rollouts(0, problems))
        assert [threads_of(a) for a in actors.rollout] == [expected.rollout] * cfg.cluster.num_rollout_actors
        actors.train(rollouts)
        assert threads_of(actors.learners[0]) == expected.learner
    finally:
        actors.shutdown()
