"""The actors of one training run, as the driver sees them: one method per phase of a step.

Every call waits with `cluster.remote_timeout_s` and names the actor that failed
("rollout actor 1", "learner rank 0", "head-consolidation actor"), by the dead actor's id: a
learner's save waiting on the consolidation actor's heads names the consolidation actor.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import ray
import torch

from specroll.configs import TrainConfig
from specroll.data import Problem
from specroll.decoders import heads_config, resumed_checkpoints
from specroll.eval.evaluation import EvalPlan, ProblemEval, batches
from specroll.learner.checkpoint import ResumeState
from specroll.rollout import GenerationStats
from specroll.rollout.decoder import DecoderCheckpoint
from specroll.speculation.drafting.heads_state import HeadsState
from specroll.telemetry import metric_names as m

from .batch import Rollouts, split_groups
from .head_consolidation_actor import HeadConsolidationActor
from .learner_actor import LearnerActor, LearnerUpdate
from .placement import Placement, as_remote, reserve
from .remote_calls import actor_names, cluster_reachable, gather
from .rollout_actor import ReplicaVersions, RolloutActor
from .sync_group import group_backend

CONSOLIDATION = "head-consolidation actor"


def rollout_name(index: int) -> str:
    return f"rollout actor {index}"


def learner_name(rank: int) -> str:
    return f"learner rank {rank}"


class PendingRollouts(NamedTuple):
    step: int
    calls: list  # (rollout actor name, pending `Rollouts`)


class PendingConsolidation(NamedTuple):
    step: int
    call: ray.ObjectRef  # the head-consolidation actor's pending `ConsolidationReport`


class RunActors:
    """`cluster.num_rollout_actors` rollout actors, `cluster.learner_world_size` learner ranks and,
    when speculating, the head-consolidation actor, with the policy version each side holds."""

    def __init__(self, cfg: TrainConfig, rollout: list, learners: list, consolidation,
                 placement: Placement | None = None) -> None:
        self.cfg, self.timeout_s = cfg, cfg.cluster.remote_timeout_s
        self.rollout, self.learners, self.consolidation = rollout, learners, consolidation
        self.placement = placement
        self.names = actor_names({**{rollout_name(i): a for i, a in enumerate(rollout)},
                                  **{learner_name(r): a for r, a in enumerate(learners)}, CONSOLIDATION: consolidation})
        self.learner_version: int | None = None
        self.rollout_version: int | None = None

    @classmethod
    def start(cls, cfg: TrainConfig) -> "RunActors":
        """Stage the model once for every actor (`ModelConfig.stage`), reserve `cfg.cluster`'s resources
        (`placement.reserve`), create the actors in them and wait until all are ready."""
        c = cfg.cluster
        cfg.model.stage(cfg.model_cache)
        placement = reserve(c, c.remote_timeout_s)
        spec = heads_config(cfg.rollout)
        # Its head updates overlap the learner's: no CPU reserved, a GPU (share) where configured.
        consolidation = (as_remote(HeadConsolidationActor, 0, c.gpus_per_consolidation_actor,
                                   c.consolidation_resources).remote(c.remote_timeout_s, spec)
                         if spec is not None else None)
        rollout_cls = as_remote(RolloutActor, c.cpus_per_rollout_actor, c.gpus_per_rollout_actor, c.rollout_resources)
        learner_cls = as_remote(LearnerActor, c.cpus_per_learner, c.gpus_per_learner, c.learner_resources)
        actors = cls(
            cfg,
            [rollout_cls.options(**placement.rollout_actor(i)).remote(cfg, i)
             for i in range(c.num_rollout_actors)],
            [learner_cls.options(**placement.learner_rank(rank)).remote(cfg, rank, c.learner_world_size)
             for rank in range(c.learner_world_size)],
            consolidation,
            placement,
        )
        try:
            actors.wait_until_ready()
        except BaseException:
            actors.shutdown()
            raise
        return actors

    def wait_until_ready(self) -> None:
        what = "start-up (a hang here can mean the Ray cluster lacks the CPUs / GPUs that cluster.* asks for)"
        address, = self.wait([(learner_name(0), self.learners[0].master_address.remote())], what)
        calls = [(learner_name(r), learner.setup.remote(address.host, address.port))
                 for r, learner in enumerate(self.learners)]
        calls += [(rollout_name(i), actor.versions.remote()) for i, actor in enumerate(self.rollout)]
        self.learner_version = self.wait(calls, what)[0]
        if self.consolidation is not None:
            self.wait([(CONSOLIDATION, self.consolidation.attach.remote(self.rollout))], what)
            # Every replica built the same initial heads; rollout actor 0's become the versioned reference.
            initial = self.rollout[0].heads_state.remote()
            self.wait([(CONSOLIDATION, self.consolidation.set_heads.remote(initial))], "set_heads (initial heads)")
        if self.cfg.cluster.weight_sync == "collective":
            self.join_weight_sync()

    def sync_members(self) -> list[tuple[str, object]]:
        """The weight-sync group's members by rank: learner rank 0 (the sender), the rollout actors,
        and the consolidation actor where the slow path trains against the policy."""
        members = [(learner_name(0), self.learners[0]), *((rollout_name(i), a) for i, a in enumerate(self.rollout))]
        return [*members, (CONSOLIDATION, self.consolidation)] if self.slow_path else members

    def join_weight_sync(self) -> None:
        """Open the weight-sync group on learner rank 0 and have every member join it, on NCCL
        where each holds a GPU of its own, else gloo."""
        what = "join_weight_sync"
        members = self.sync_members()
        devices = self.wait([(name, actor.weight_sync_device.remote()) for name, actor in members], what)
        (address, plan), = self.wait([(learner_name(0), self.learners[0].open_weight_sync.remote())], what)
        backend = group_backend(devices)
        self.wait([(name, actor.join_weight_sync.remote(address, rank, len(members), backend, plan, self.timeout_s))
                   for rank, (name, actor) in enumerate(members)], f"{what} ({backend} at {address.host}:{address.port})")

    def wait(self, calls: list, what: str, on_result: Callable | None = None, collective: bool = False) -> list:
        """`gather` with the run's timeout, naming whichever of the run's actors died."""
        return gather(calls, what, self.timeout_s, on_result, self.names, collective)

    def check_run_dir(self, run_dir: str, token: str) -> None:
        """Every actor reads the token the driver wrote into `run_dir`: all of them see the same storage."""
        calls = [(rollout_name(i), actor.check_run_dir.remote(run_dir, token)) for i, actor in enumerate(self.rollout)]
        calls += [(learner_name(r), learner.check_run_dir.remote(run_dir, token))
                  for r, learner in enumerate(self.learners)]
        if self.consolidation is not None:
            calls.append((CONSOLIDATION, self.consolidation.check_run_dir.remote(run_dir, token)))
        gather(calls, f"check_run_dir ({run_dir})", self.timeout_s)

    def sync_policy(self) -> int:
        """Give every rollout actor the learner's current weights unless they hold them already;
        returns the policy version they now hold. How: `cluster.weight_sync`."""
        if self.rollout_version == self.learner_version:
            return self.rollout_version
        self.rollout_version = self.stream_policy() if self.cfg.cluster.weight_sync == "collective" else self.put_policy()
        return self.rollout_version

    def stream_policy(self) -> int:
        """The learner ranks stream the weights bucket by bucket over the weight-sync group (`sync_group`);
        a member's failure is reported as the death of a member where one died."""
        version = self.learner_version
        calls = [(learner_name(r), learner.send_policy.remote()) for r, learner in enumerate(self.learners)]
        calls += [(name, actor.receive_policy.remote(version)) for name, actor in self.sync_members()[1:]]
        self.wait(calls, f"sync_policy (policy version {version})", collective=True)
        return version

    def put_policy(self) -> int:
        """Rank 0 packs the weights in the replicas' dtype into one object (`FlatWeights`) in the object
        store; every rollout actor reads that same object in place and copies it into its parameters."""
        published = [learner.policy_weights.options(num_returns=2).remote() for learner in self.learners]
        versions = self.wait([(learner_name(r), version) for r, (version, _) in enumerate(published)], "policy_weights")
        version, weights = versions[0], published[0][1]
        calls = [(rollout_name(i), actor.load_policy.remote(version, weights)) for i, actor in enumerate(self.rollout)]
        if self.slow_path:
            calls.append((CONSOLIDATION, self.consolidation.load_policy.remote(version, weights)))
        self.wait(calls, f"load_policy (policy version {version})")
        return version

    def start_rollouts(self, step: int, problems: list[Problem], first_index: int = 0) -> PendingRollouts:
        """Ask each rollout actor for its shard of whole groups (the first actors only, where the
        prompts are fewer), `problems[j]` as prompt `first_index + j` of the step; results via
        `collect_rollouts`."""
        shards = split_groups(len(problems), min(len(problems), len(self.rollout)))
        return PendingRollouts(step, [
            (rollout_name(i), actor.generate.remote(step, self.rollout_version,
                                                    [(first_index + j, problems[j]) for j in shard]))
            for i, (actor, shard) in enumerate(zip(self.rollout, shards))
        ])

    def collect_rollouts(self, pending: PendingRollouts,
                         on_shard: Callable[[Rollouts], None] | None = None) -> Rollouts:
        """The step's rollouts, in prompt order; `on_shard` sees each actor's shard as it lands."""
        return Rollouts.concat(self.wait(pending.calls, f"generate (step {pending.step})", on_shard))

    @property
    def slow_path(self) -> bool:
        spec = heads_config(self.cfg.rollout)
        return spec is not None and spec.uses_slow_path

    def start_consolidation(self, rollouts: Rollouts) -> PendingConsolidation | None:
        """Hand the step's head telemetry and records to the consolidation actor; its drift check
        and any head update run while the learner trains. None without a slow path."""
        if not self.slow_path:
            return None
        return PendingConsolidation(rollouts.step,
                                    self.consolidation.consolidate.remote(rollouts.step, rollouts.head_records))

    def finish_consolidation(self, pending: PendingConsolidation | None) -> float:
        """Wait for the step's consolidation (the head update and its broadcast); returns the seconds waited."""
        if pending is None:
            return 0.0
        started = time.perf_counter()
        self.wait([(CONSOLIDATION, pending.call)], f"consolidate (step {pending.step})")
        return time.perf_counter() - started

    def train(self, rollouts: Rollouts) -> LearnerUpdate:
        """One GRPO update on the rollouts, each rank on its share of whole groups."""
        shards = split_groups(len(rollouts), len(self.learners))
        calls = [(learner_name(r), learner.train.remote(rollouts.select(shard)))
                 for r, (learner, shard) in enumerate(zip(self.learners, shards))]
        results = self.wait(calls, f"train (step {rollouts.step})")
        update = LearnerUpdate.of_ranks(results)
        self.learner_version = int(update.metrics[m.POLICY_VERSION])
        return update

    def evaluate(self, problems: list[Problem], plan: EvalPlan, batch_size: int) -> list[ProblemEval]:
        """The held-out `problems` answered by the rollout actors' current policy, in order: fixed
        batches of `batch_size`, dealt round-robin, so the results do not depend on the actor count."""
        calls = [(rollout_name(i % len(self.rollout)), self.rollout[i % len(self.rollout)].evaluate.remote(batch, plan))
                 for i, batch in enumerate(batches(problems, batch_size))]
        return [result for batch in gather(calls, f"evaluate (policy version {self.rollout_version})", self.timeout_s)
                for result in batch]

    def save(self, root: str, step: int, data_position: dict, wandb_run_id: str | None, run_config: dict,
             keep_last: int) -> str:
        """A complete checkpoint of `step` finished steps: learner ranks, data position, heads, W&B id, config."""
        heads = self.consolidation.heads.remote() if self.consolidation is not None else None
        kept = self.decoder_checkpoints()
        drafter = [k.drafter for k in kept] if kept[0].drafter is not None else None
        history = [k.draft_history for k in kept] if kept[0].draft_history is not None else None
        calls = [(learner_name(r), learner.save.remote(root, step, data_position, heads if r == 0 else None,
                                                      wandb_run_id, run_config, keep_last, drafter if r == 0 else None,
                                                      history if r == 0 else None))
                 for r, learner in enumerate(self.learners)]
        return self.wait(calls, f"save_checkpoint (step {step})")[0]

    def restore(self, path: str) -> ResumeState:
        """Load checkpoint `path` into every learner rank and its heads into the consolidation
        actor; returns rank 0's record."""
        calls = [(learner_name(r), learner.restore.remote(path)) for r, learner in enumerate(self.learners)]
        resumed = self.wait(calls, f"load_checkpoint ({path})")[0]
        self.learner_version = resumed.policy_version
        if resumed.heads is not None and self.consolidation is not None:
            self.wait([(CONSOLIDATION, self.consolidation.set_heads.remote(resumed.heads))], "set_heads (checkpointed heads)")
        states = resumed_checkpoints(resumed.drafter, resumed.draft_history, len(self.rollout))
        if states is not None:
            calls = [(rollout_name(i), actor.load_decoder_checkpoint.remote(state))
                     for i, (actor, state) in enumerate(zip(self.rollout, states))]
            self.wait(calls, "load_decoder_checkpoint (checkpointed drafters, history lookup)")
        return resumed

    def heads_metrics(self) -> dict[str, float]:
        """timing_s/head_sync and heads/* since the last call (`HeadsStepStats`); empty without speculation."""
        if self.consolidation is None:
            return {}
        stats = self.wait([(CONSOLIDATION, self.consolidation.step_stats.remote())], "step_stats")[0]
        return stats.metrics()

    def publish_heads(self, state: dict[str, torch.Tensor]) -> int:
        """New draft-head weights for every rollout actor; returns their version."""
        return self.wait([(CONSOLIDATION, self.consolidation.publish_heads.remote(state))], "publish_heads")[0]

    def of_rollout_actors(self, pending: list, what: str) -> list:
        """The results of one pending call per rollout actor, in actor order."""
        return self.wait([(rollout_name(i), ref) for i, ref in enumerate(pending)], what)

    def rollout_versions(self) -> list[ReplicaVersions]:
        return self.of_rollout_actors([actor.versions.remote() for actor in self.rollout], "versions")

    def rollout_heads(self) -> list[HeadsState | None]:
        """The draft heads each rollout actor holds."""
        return self.of_rollout_actors([actor.heads_state.remote() for actor in self.rollout], "heads_state")

    def rollout_stats(self) -> list[GenerationStats | None]:
        """Each rollout actor's engine stats of its last generate call."""
        return self.of_rollout_actors([actor.last_rollout_stats.remote() for actor in self.rollout], "last_rollout_stats")

    def decoder_checkpoints(self) -> list[DecoderCheckpoint]:
        """What a checkpoint keeps of each rollout actor's decoder."""
        return self.of_rollout_actors([actor.decoder_checkpoint.remote() for actor in self.rollout], "decoder_checkpoint")

    def rollout_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[list[float]]]:
        """Log-probs of given responses under each rollout actor's policy (`RolloutActor.response_logprobs`)."""
        return self.of_rollout_actors([actor.response_logprobs.remote(prompt_ids, response_ids) for actor in self.rollout],
                                      "response_logprobs")

    def learner_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """Log-probs of given responses under the learner's policy (every rank computes; rank 0's)."""
        calls = [(learner_name(r), learner.response_logprobs.remote(prompt_ids, response_ids))
                 for r, learner in enumerate(self.learners)]
        return self.wait(calls, "response_logprobs")[0]

    def shutdown(self) -> None:
        for actor in [*self.rollout, *self.learners, self.consolidation]:
            if actor is not None:
                ray.kill(actor)
        # A lost cluster's GCS cannot answer the removal (which would wait on it); its groups went with it.
        if self.placement is not None and cluster_reachable():
            self.placement.remove()
