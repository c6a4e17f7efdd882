"""Actors on a real local Ray cluster with a tiny model: two rollout actors, a learner and the
head-consolidation actor take two GRPO steps; weights, heads and telemetry travel versioned."""
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import ray
import torch
from hydra import compose, initialize_config_dir

from specroll.actors import (
    ActorFailedError,
    ActorTimeoutError,
    HeadConsolidationActor,
    LearnerUpdate,
    RolloutActor,
    Rollouts,
    RunActors,
    as_remote,
    gather,
    split_groups,
)
from specroll.configs import load_train_config
from specroll.data import load_problems
from specroll.models.flat_weights import FlatWeights
from specroll.speculation import HorizonHeads
from specroll.speculation.adaptation.consolidation import HeadConsolidator
from specroll.speculation.drafting.heads_state import HeadsState
from specroll.telemetry import metric_names as m

CONF = Path(__file__).resolve().parents[1] / "conf"
PROMPTS, GROUP = 4, 2
# Rewards of a random tiny model are all 0, so advantages are 0: weight decay is what moves
# the weights, enough that an actor still on old weights gives other log-probs.
OVERRIDES = [
    "experiment=smoke",
    "cluster.num_rollout_actors=2",
    f"data.prompts_per_step={PROMPTS}",
    f"rollout.n={GROUP}",
    "learner.lr=0.1",
    "learner.weight_decay=1.0",
]


def config(overrides=()):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return load_train_config(compose("config", overrides=OVERRIDES + list(overrides)))


def test_split_groups_gives_contiguous_near_equal_shards():
    assert split_groups(5, 2) == [range(0, 3), range(3, 5)]
    assert split_groups(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match="3 prompts cannot be split into 4"):
        split_groups(3, 4)


def test_rollouts_concat_in_prompt_order_and_select_whole_groups():
    def part(first, version=0):
        return Rollouts(step=3, group_size=2, policy_version=version, head_version=first, prompt_indices=[first],
                        prompt_ids=[[first]], response_ids=[[first, 0], [first, 1]], logprobs=[[0.0], [0.0]],
                        finish_reasons=["stop", "length"], rewards=[1.0, 0.0], correct=[True, False], gen_s=first)

    whole = Rollouts.concat([part(1), part(0)])
    assert whole.prompt_indices == [0, 1] and whole.response_ids == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert (whole.head_version, whole.gen_s) == (0, 1)
    second = whole.select(range(1, 2))
    assert second.prompt_ids_per_response() == [[1], [1]] and second.truncated() == [False, True]
    with pytest.raises(ValueError, match=r"policy versions \[0, 1\]"):
        Rollouts.concat([part(0), part(1, version=1)])


def test_responses_do_not_depend_on_how_the_prompts_are_split():
    """Used in-process (no Ray): one actor generating the batch whole or as two shards."""
    torch.set_num_threads(1)
    cfg = config()
    actor = RolloutActor(cfg, index=0)
    actor.load_policy(0, FlatWeights.pack(actor.model.state_dict()))
    problems = load_problems("synthetic", synthetic=cfg.data.synthetic)[:PROMPTS]
    whole = actor.generate(5, 0, list(enumerate(problems)))
    shards = [actor.generate(5, 0, [(i, problems[i]) for i in r]) for r in split_groups(PROMPTS, 2)]
    assert Rollouts.concat(shards).response_ids == whole.response_ids
    other_step = actor.generate(6, 0, list(enumerate(problems)))
    assert other_step.response_ids != whole.response_ids


@pytest.fixture(scope="module")
def two_steps(ray_cluster):
    """Two GRPO steps through the driver's calls; the rollout actors then get the newest policy."""
    cfg = config()
    actors = RunActors.start(cfg)
    problems = load_problems("synthetic", synthetic=cfg.data.synthetic)
    steps = []
    for step in range(2):
        synced = actors.sync_policy()
        rollouts = actors.collect_rollouts(actors.start_rollouts(step, problems[step * PROMPTS:(step + 1) * PROMPTS]))
        steps.append({"synced": synced, "rollouts": rollouts, "trained": actors.train(rollouts)})
    actors.sync_policy()
    yield cfg, actors, problems, steps
    actors.shutdown()


def test_two_grpo_steps_increment_the_policy_version(two_steps):
    _, actors, _, steps = two_steps
    assert [s["synced"] for s in steps] == [0, 1]
    assert [s["rollouts"].policy_version for s in steps] == [0, 1]
    assert [s["trained"].metrics[m.POLICY_VERSION] for s in steps] == [1, 2]
    assert all(s["trained"].metrics[m.NUM_SEQUENCES] == PROMPTS * GROUP for s in steps)
    assert steps[1]["rollouts"].prompt_indices == list(range(PROMPTS))
    assert len(steps[1]["rollouts"].engine_stats) == 2  # one per rollout actor
    assert actors.learner_version == 2
    assert [v.policy for v in actors.rollout_versions()] == [2, 2]


def test_every_rollout_actor_scores_a_response_as_the_learner_does(two_steps):
    _, actors, _, steps = two_steps
    rollouts = steps[0]["rollouts"]
    prompts, responses = rollouts.prompt_ids_per_response()[:3], rollouts.response_ids[:3]
    learner = actors.learner_logprobs(prompts, responses)
    for replica in actors.rollout_logprobs(prompts, responses):
        for ours, theirs in zip(replica, learner):
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0, atol=1e-5)
    # The log-probs the responses were sampled with (version 0) are clearly others.
    old = torch.tensor(rollouts.logprobs[0])
    assert (torch.tensor(learner[0]) - old).abs().max() > 1e-3


def test_published_heads_reach_every_rollout_actor(two_steps):
    _, actors, problems, _ = two_steps
    initial = actors.rollout_heads()[0]
    new_state = {k: v + 0.01 for k, v in initial.state.items()}
    assert actors.publish_heads(new_state) == initial.version + 1
    assert [v.heads for v in actors.rollout_versions()] == [1, 1]
    for held in actors.rollout_heads():
        assert held.version == 1 and all(torch.equal(held.state[k], new_state[k]) for k in new_state)
    # A stale broadcast never replaces newer heads.
    assert ray.get([actor.set_heads.remote(replace(initial, version=0)) for actor in actors.rollout]) == [1, 1]
    metrics = actors.heads_metrics()
    assert metrics["heads/version"] == 1 and metrics["timing_s/head_sync"] > 0
    rollouts = actors.collect_rollouts(actors.start_rollouts(2, problems[:PROMPTS]))
    assert rollouts.head_version == 1


def test_heads_saved_as_dicts_restore_the_consolidation_actor(two_steps, tmp_path):
    """`heads.pt` holds plain dicts, in checkpoints old and new: they restore the heads and the slow path's state."""
    cfg, actors, _, _ = two_steps
    initial = actors.rollout_heads()[0]
    spec = replace(cfg.rollout.speculation, adaptation="slow")
    consolidator = HeadConsolidator(HorizonHeads.from_state(asdict(initial.meta), initial.state), spec.adaptation,
                                    spec.drift, spec.consolidation)
    consolidator.detector.step, consolidator.detector.triggers = 7, 2
    torch.save({"version": 5, "state": initial.state, "meta": asdict(initial.meta),
                "consolidation": consolidator.state_dict()}, tmp_path / "heads.pt")
    restored = as_remote(HeadConsolidationActor, num_cpus=0).remote(60.0, spec)
    saved = HeadsState.load(tmp_path / "heads.pt")
    assert ray.get(restored.set_heads.remote(saved)) == 5
    held = ray.get(restored.heads.remote())
    assert held.meta == initial.meta and held.consolidation["detector"]["step"] == 7
    assert ray.get(restored.step_stats.remote()).slow_path.drift_triggers == 2
    # The oldest heads.pt holds the version and weights alone: the actor keeps the meta it has.
    torch.save({"version": 6, "state": initial.state}, tmp_path / "heads.pt")
    saved = HeadsState.load(tmp_path / "heads.pt")
    assert saved.meta is None and ray.get(restored.set_heads.remote(saved)) == 6
    held = ray.get(restored.heads.remote())
    assert held.version == 6 and held.meta == initial.meta
    ray.kill(restored)


def test_a_rollout_actor_refuses_to_generate_with_another_policy_version(two_steps):
    _, actors, problems, _ = two_steps
    call = actors.rollout[0].generate.remote(9, 1, [(0, problems[0])])
    with pytest.raises(ActorFailedError, match="rollout actor 0 failed in generate: ValueError: rollout actor 0 "
                                               "holds policy version 2, but step 9 must be generated with version 1"):
        gather([("rollout actor 0", call)], "generate", timeout_s=60)


def test_slow_and_dead_actors_are_named(two_steps):
    _, actors, problems, _ = two_steps
    call = actors.rollout[1].generate.remote(9, 2, [(0, problems[0])])
    with pytest.raises(ActorTimeoutError, match=r"rollout actor 1 did not finish generate within 0.001 s"):
        gather([("rollout actor 1", call)], "generate", timeout_s=0.001)
    ray.get(call)  # let it finish: the actor stays usable
    doomed = as_remote(HeadConsolidationActor, num_cpus=0).remote(1.0)
    ray.kill(doomed)
    with pytest.raises(ActorFailedError, match="head-consolidation actor died during step_stats"):
        gather([("head-consolidation actor", doomed.step_stats.remote())], "step_stats", timeout_s=60)


def test_a_step_update_lasts_as_long_as_its_slowest_rank_and_counts_every_ranks_tokens():
    metrics = {m.LOSS: 0.5, m.POLICY_VERSION: 3.0}  # reduced over ranks: the same on each
    ranks = [LearnerUpdate(metrics, 1.0, 4.0, 100), LearnerUpdate(metrics, 2.0, 3.0, 60)]
    assert LearnerUpdate.of_ranks(ranks) == LearnerUpdate(metrics, 2.0, 4.0, 160)
