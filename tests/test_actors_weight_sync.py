"""Weight sync on a real local Ray cluster with a tiny model, by either path (`cluster.weight_sync`):
after a sync the rollout replica holds exactly the learner's weights in its own dtype, and generates with them."""
from pathlib import Path

import pytest
import ray
import torch
from hydra import compose, initialize_config_dir

from specroll.actors import RunActors
from specroll.configs import load_train_config
from specroll.data import load_problems

CONF = Path(__file__).resolve().parents[1] / "conf"
PROMPTS = 2
# Rewards of a random tiny model are all 0: weight decay is what moves the weights.
OVERRIDES = ["experiment=smoke", f"data.prompts_per_step={PROMPTS}", "learner.lr=0.1", "learner.weight_decay=1.0"]


RAY_CPUS = 2  # logical CPUs of this module's Ray cluster (conftest.ray_cluster)


def in_actor(actor, fn):
    """`fn(actor instance)`, run inside the actor."""
    return ray.get(actor.__ray_call__.remote(fn), timeout=120)


@pytest.mark.parametrize("path", ["collective", "object_store"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_after_a_sync_the_replica_generates_with_exactly_the_learners_weights(ray_cluster, dtype, path):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = load_train_config(compose("config", overrides=[*OVERRIDES, f"model.dtype={dtype}",
                                                             f"cluster.weight_sync={path}"]))
    problems = load_problems("synthetic", synthetic=cfg.data.synthetic)
    actors = RunActors.start(cfg)
    try:
        _, initial = in_actor(actors.learners[0], lambda a: a.learner.policy_state_dict())
        assert actors.sync_policy() == 0
        first = actors.collect_rollouts(actors.start_rollouts(0, problems[:PROMPTS]))
        actors.train(first)
        assert actors.sync_policy() == 1
        version, learner = in_actor(actors.learners[0], lambda a: a.learner.policy_state_dict())
        replica = in_actor(actors.rollout[0], lambda a: a.model.state_dict())
        assert version == 1 and set(replica) == set(learner)
        assert any(not torch.equal(learner[k], initial[k]) for k in learner)  # the update moved the weights
        assert all(replica[k].dtype == getattr(torch, dtype) for k in replica)
        assert all(torch.equal(replica[k], learner[k].to(replica[k].dtype)) for k in learner)
        if dtype != "float32":
            return  # bf16 log-probs differ from the float32 learner's by more than the update moves them
        second = actors.collect_rollouts(actors.start_rollouts(1, problems[PROMPTS:2 * PROMPTS]))
        assert second.policy_version == 1
        # Sampled with version 1's weights (the replica's packed linears were rebuilt after the copy) ...
        new = actors.learner_logprobs(second.prompt_ids_per_response(), second.response_ids)
        for sampled, learned in zip(second.logprobs, new):
            torch.testing.assert_close(torch.tensor(sampled), torch.tensor(learned), rtol=0, atol=1e-4)
        # ... which give clearly other log-probs than version 0's did.
        moved = actors.learner_logprobs(first.prompt_ids_per_response(), first.response_ids)
        assert max((torch.tensor(a) - torch.tensor(b)).abs().max() for a, b in zip(moved, first.logprobs)) > 1e-2
    finally:
        actors.shutdown()
