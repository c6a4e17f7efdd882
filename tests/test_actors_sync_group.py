"""Weight sync over the collective (`cluster.weight_sync=collective`) between real Ray actors on gloo,
with a tiny model: every replica holds the learner's weights bitwise in its own dtype; the version
is checked at the end, and a replica that failed the check holds no version; ZeRO-3 learner ranks
gather one bucket at a time; a rollout actor killed during a sync is named and `resume=auto` goes on."""
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from hydra import compose, initialize_config_dir

from specroll.actors import RunActors
from specroll.actors.remote_calls import ActorFailedError, actor_names, gather
from specroll.actors.sync_group import MemberDevice, group_backend
from specroll.configs import load_train_config
from specroll.data import load_problems
from specroll.models.weight_buckets import BucketPlan
from specroll.train import WEIGHT_SYNC, run_training

CONF = Path(__file__).resolve().parents[1] / "conf"
RAY_CPUS = 8  # two learner ranks and two rollout actors, twice: the module's and a training run's
PROMPTS = 2
BUCKET_MB = 1 / 64  # the tiny model's layers take a few buckets; its embeddings and LM head (3 MiB each in bf16) one each
# Two ZeRO-3 learner ranks, two bfloat16 replicas; rewards of a random tiny model are all 0, weight decay moves the weights.
OVERRIDES = ["experiment=smoke", f"data.prompts_per_step={PROMPTS}", "learner.lr=0.1", "learner.weight_decay=1.0",
             "cluster.num_rollout_actors=2", "cluster.learner_world_size=2", "learner.zero_stage=3",
             "cluster.weight_sync=collective", f"cluster.weight_sync_bucket_mb={BUCKET_MB}", "cluster.phase_threads=false"]


def config(overrides=()):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return load_train_config(compose("config", overrides=[*OVERRIDES, *overrides]))


def in_actor(actor, fn):
    """`fn(actor instance)`, run inside the actor."""
    return ray.get(actor.__ray_call__.remote(fn), timeout=120)


def learner_weights(actors):
    """The learner's full weights, gathered on every rank at once (ZeRO-3); rank 0's."""
    calls = [learner.__ray_call__.remote(lambda a: a.learner.policy_state_dict()) for learner in actors.learners]
    return ray.get(calls, timeout=120)[0]


def watch_gathers(learner):
    """From now on the learner rank records, at each `GatheredParameters` it enters, how many of its
    policy's elements are whole at once (ZeRO-3 keeps small parameters whole all along)."""
    def install(actor):
        import deepspeed
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        actor.gathered_at_once = []
        enter = deepspeed.zero.GatheredParameters.__enter__

        def recording_enter(self):
            enter(self)
            params = actor.learner.module.parameters()
            actor.gathered_at_once.append(sum(p.ds_numel for p in params if p.ds_status == ZeroParamStatus.AVAILABLE))

        deepspeed.zero.GatheredParameters.__enter__ = recording_enter
    in_actor(learner, install)


@pytest.fixture(scope="module")
def actors(ray_cluster):
    cfg = config(["model.dtype=bfloat16"])
    started = RunActors.start(cfg)
    yield started
    started.shutdown()


def test_every_replica_holds_the_learners_weights_bitwise_and_zero3_ranks_gather_bucket_by_bucket(actors):
    problems = load_problems("synthetic", synthetic=actors.cfg.data.synthetic)
    initial = learner_weights(actors)
    assert actors.sync_policy() == 0
    actors.train(actors.collect_rollouts(actors.start_rollouts(0, problems[:PROMPTS])))
    for learner in actors.learners:
        watch_gathers(learner)
    assert actors.sync_policy() == 1
    # Each rank gathered once per bucket, never more of the model at once than its largest bucket
    # beside the parameters ZeRO-3 keeps whole: about half the tiny model (its LM head), not all of it.
    gathered = [in_actor(learner, lambda a: a.gathered_at_once) for learner in actors.learners]
    plan = in_actor(actors.learners[0], lambda a: a.sync_plan())
    total, kept_whole = in_actor(actors.learners[0], lambda a: (
        sum(p.ds_numel for p in a.learner.module.parameters()),
        sum(p.ds_numel for p in a.learner.module.parameters() if p.ds_persist)))
    largest = max(sum(slot.numel for slot in bucket.slots) for bucket in plan.buckets)
    assert len(plan.buckets) > 3
    for at_once in gathered:
        assert len(at_once) == len(plan.buckets)
        assert max(at_once) <= largest + kept_whole < 0.6 * total
    version, learner = learner_weights(actors)
    assert version == 1 and any(not torch.equal(learner[k], initial[1][k]) for k in learner)  # the update moved them
    for replica in actors.rollout:
        weights = in_actor(replica, lambda a: a.model.state_dict())
        assert set(weights) == set(learner) and all(w.dtype == torch.bfloat16 for w in weights.values())
        assert all(torch.equal(weights[k], learner[k].to(torch.bfloat16)) for k in learner)
    assert in_actor(actors.rollout[1], lambda a: a.versions().policy) == 1


def test_a_version_that_fails_the_check_leaves_the_replica_without_one_until_a_sync_succeeds(actors):
    problems = load_problems("synthetic", synthetic=actors.cfg.data.synthetic)
    held = actors.learner_version
    actors.learner_version, actors.rollout_version = held + 1, None  # the driver expects a version the learner lacks
    with pytest.raises(ActorFailedError, match=(
            rf"rollout actor \d failed in sync_policy \(policy version {held + 1}\): ValueError: weight sync sent "
            rf"policy version {held} \(\d+ bytes\) where version {held + 1} \(\d+ bytes\) was expected")):
        actors.sync_policy()
    assert [v.policy for v in actors.rollout_versions()] == [None, None]
    with pytest.raises(ray.exceptions.RayTaskError, match="holds policy version None"):
        ray.get(actors.rollout[0].generate.remote(9, held, [(0, problems[0])]), timeout=120)
    actors.learner_version, actors.rollout_version = held, None
    assert actors.sync_policy() == held
    assert [v.policy for v in actors.rollout_versions()] == [held, held]


@pytest.mark.parametrize("devices, backend", [
    ([MemberDevice("cuda", "n1/0"), MemberDevice("cuda", "n1/1"), MemberDevice("cuda", "n2/0")], "nccl"),
    ([MemberDevice("cuda", "n1/0"), MemberDevice("cuda", "n1/1"), MemberDevice("cuda", "n1/1")], "gloo"),  # a shared GPU
    ([MemberDevice("cuda", "n1/0"), MemberDevice("cpu", None)], "gloo"),
    ([MemberDevice("cpu", None), MemberDevice("cpu", None)], "gloo"),
])
def test_nccl_only_where_every_member_holds_a_gpu_of_its_own(devices, backend):
    assert group_backend(devices) == backend


def test_a_members_failure_in_a_collective_is_reported_as_the_death_that_caused_it(ray_cluster):
    class Member:  # defined here, so that Ray ships it by value: workers cannot import this module
        """A stand-in member of a collective: one whose collective fails, one still in it."""

        def fail_after(self, seconds: float) -> None:
            time.sleep(seconds)
            raise RuntimeError("Connection closed by peer")

        def wait(self, seconds: float) -> None:
            time.sleep(seconds)

    survivor, victim = (ray.remote(num_cpus=0)(Member).remote() for _ in range(2))
    ray.get([survivor.__ray_ready__.remote(), victim.__ray_ready__.remote()], timeout=120)
    names = actor_names({"learner rank 0": survivor, "rollout actor 0": victim})
    calls = [("learner rank 0", survivor.fail_after.remote(0.5)), ("rollout actor 0", victim.wait.remote(120))]
    threading.Timer(2.0, ray.kill, [victim]).start()  # Ray learns of the death after the survivor's error
    with pytest.raises(ActorFailedError, match=r"^rollout actor 0 died during sync_policy"):
        gather(calls, "sync_policy", 120, names=names, collective=True)


def io_bytes(pid: int, field: str) -> int:
    return int(next(line.split()[1] for line in Path(f"/proc/{pid}/io").read_text().splitlines()
                    if line.startswith(field + ":")))


def logged_steps(run_dir):
    return [json.loads(line)["step"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_a_rollout_actor_killed_during_a_sync_is_named_and_resume_auto_continues(ray_cluster, tmp_path):
    overrides = [f"run_dir={tmp_path / 'run'}", "total_steps=3", "checkpoint_every=1", "logger.console=false"]
    streamed = []

    def kill_during_sync(step, phase, actors):
        """At step 1's sync: rollout actor 0 is stopped, so the sync cannot finish without it; once
        learner rank 0 has streamed a MiB of it, rollout actor 0 is killed."""
        if (step, phase) != (1, WEIGHT_SYNC):
            return
        victim, sender = (in_actor(actor, lambda a: os.getpid()) for actor in (actors.rollout[0], actors.learners[0]))
        before = io_bytes(sender, "wchar")
        os.kill(victim, signal.SIGSTOP)

        def kill_once_streaming():
            deadline = time.monotonic() + 60
            while io_bytes(sender, "wchar") - before < 2**20 and time.monotonic() < deadline:
                time.sleep(0.01)
            streamed.append(io_bytes(sender, "wchar") - before)
            os.kill(victim, signal.SIGKILL)

        threading.Thread(target=kill_once_streaming, daemon=True).start()

    with pytest.raises(ActorFailedError, match=r"rollout actor 0 died during sync_policy \(policy version 1\)"):
        run_training(config(overrides), on_phase=kill_during_sync)
    payload = BucketPlan.of(config().model.load()[0], torch.float32, 2**20).nbytes
    assert 2**20 <= streamed[0] < 2 * payload  # under way, unfinished: two replicas were to receive it
    summary = run_training(config(overrides))  # resume=auto
    assert (summary.first_step, summary.policy_version) == (1, 3)
    assert logged_steps(tmp_path / "run") == [0, 1, 2]
