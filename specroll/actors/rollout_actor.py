"""The rollout actor: a policy replica with draft heads and the speculative engine.

Per step it generates `rollout.n` responses to each prompt of its shard, scores them, has its
decoder learn from them (history lookup keeps them; a FastGRPO drafter trains on them online,
paid for inside the step, as FastGRPO does) and returns `Rollouts`, with the slow path's head
records. It asks its decoder only what `decoders.RolloutDecoder` offers, whatever the mode.
Policy weights and head weights arrive through their own calls, each with a version; Ray runs
an actor's calls one at a time, so weights never change during a generate call, and a generate
call names the policy version it expects, so a replica that missed an update refuses rather
than mixing versions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from specroll.configs import TrainConfig, validate_against_model
from specroll.data import Problem, format_prompt, score_responses
from specroll.decoders import RolloutDecoder, build_decoder
from specroll.eval.evaluation import EvalPlan, ProblemEval, evaluate_problems
from specroll.learner import GRPOSamples, pad_samples, sequence_logprobs
from specroll.models.flat_weights import FlatWeights
from specroll.models.weight_buckets import BucketPlan, unpack_bucket
from specroll.rollout import GenerationStats, RolloutEngine
from specroll.rollout.decoder import DecoderCheckpoint
from specroll.run_dir import SeesRunDir
from specroll.speculation.drafting.heads_state import HeadsState

from .batch import Rollouts, prompt_key
from .placement import actor_device, model_cache, use_cpus
from .rendezvous import MasterAddress
from .sync_group import MemberDevice, SyncGroup, member_device
from .threads import node_cores, phase_threads, use_threads


@dataclass(frozen=True)
class ReplicaVersions:
    """The versions a rollout actor generates with."""

    policy: int | None  # the learner's policy version it holds; None before the first sync
    heads: int | None  # its draft heads' version; None without horizon heads


class RolloutActor(SeesRunDir):
    """Generates and scores its shard of each step's prompts.

    Args:
        cfg: the run's config (model, rollout, data.reward, seed, cluster resources).
        index: this actor's number, used in errors and telemetry (and in the seed of what its decoder learns).
    """

    def __init__(self, cfg: TrainConfig, index: int) -> None:
        use_cpus(cfg.cluster.cpus_per_rollout_actor)
        self.cfg, self.index = cfg, index
        model, tokenizer = replace(cfg.model, device=actor_device(cfg.model.device)).load(cfg.seed, model_cache(cfg))
        validate_against_model(cfg, model.config.max_position_embeddings)
        if tokenizer is None:
            raise ValueError("model.tokenizer must be set: prompts are formatted and responses scored as text")
        self.model, self.tokenizer = model, tokenizer
        self.decoder: RolloutDecoder = build_decoder(model, cfg.rollout, seed=cfg.seed + index)
        self.engine = RolloutEngine(model, tokenizer, self.decoder, sync_every=cfg.rollout.sync_every)
        self.policy_version: int | None = None  # the initial weights are not a learner version yet
        self.sync: SyncGroup | None = None  # its end of the weight-sync group (weight_sync=collective)
        self.threads = phase_threads(cfg.cluster, node_cores()).rollout  # while generating
        self.last_stats: GenerationStats | None = None  # the last generate call's engine stats

    def versions(self) -> ReplicaVersions:
        return ReplicaVersions(self.policy_version, self.decoder.heads_version)

    def load_policy(self, version: int, weights: FlatWeights) -> int:
        """Replace all policy weights with the learner's `version`, in place (read from the object store without a copy)."""
        weights.copy_into(self.model)
        self.policy_version = version
        return version

    def weight_sync_device(self) -> MemberDevice:
        return member_device(next(self.model.parameters()).device)

    def join_weight_sync(self, address: MasterAddress, rank: int, size: int, backend: str, plan: BucketPlan,
                         timeout_s: float) -> None:
        """Join the weight-sync group, once the plan is checked against this replica's weights."""
        plan.check(self.model)
        self.sync = SyncGroup.join(address, rank, size, backend, plan, timeout_s)

    def receive_policy(self, version: int) -> int:
        """Replace all policy weights with the learner's `version`, streamed bucket by bucket into
        place. Until the last bucket and the version check pass it holds no version, so a generate
        call refuses to run on half a sync (and after a failed one, until the next succeeds)."""
        self.policy_version = None
        targets = self.model.state_dict()
        self.sync.receive(version, lambda bucket, flat: unpack_bucket(bucket, flat, targets))
        self.policy_version = version
        return version

    def heads_state(self) -> HeadsState | None:
        """The draft heads, copied to the CPU; None without horizon heads."""
        return self.decoder.heads_state()

    def set_heads(self, heads: HeadsState) -> int:
        """Draft with `heads` from the next generate call on; an older version is ignored. Returns the version held."""
        return self.decoder.load_heads(heads)

    def last_rollout_stats(self) -> GenerationStats | None:
        """The engine stats of the last generate call (per decode step: `active_rows_per_step`, and
        `tree.budget_per_step` when drafting), for benchmarks; None before any."""
        return self.last_stats

    def decoder_checkpoint(self) -> DecoderCheckpoint:
        """What a run checkpoint keeps of its decoder (an online drafter, history lookup's responses), on the CPU."""
        return self.decoder.checkpoint_state()

    def load_decoder_checkpoint(self, state: DecoderCheckpoint) -> None:
        """Resume its decoder from `decoder_checkpoint()`'s output (a checkpoint's)."""
        self.decoder.load_checkpoint_state(state)

    def generate(self, step: int, policy_version: int, problems: list[tuple[int, Problem]]) -> Rollouts:
        """Responses to `problems` (each with its index in the step's batch) and their rewards."""
        if self.policy_version != policy_version:
            raise ValueError(
                f"rollout actor {self.index} holds policy version {self.policy_version}, "
                f"but step {step} must be generated with version {policy_version}"
            )
        use_threads(self.threads)
        started = time.perf_counter()
        instruction = self.cfg.data.instruction
        prompts = [format_prompt(self.tokenizer, problem.question, instruction) for _, problem in problems]
        params = self.cfg.rollout.sampling_params(seed=self.cfg.seed)
        out = self.engine.generate(prompts, params, prompt_keys=[prompt_key(step, i) for i, _ in problems])
        generated = time.perf_counter()
        self.last_stats = out.stats
        texts = self.tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)
        golds = [problem.answer for _, problem in problems for _ in range(params.n)]
        scores = score_responses(texts, golds, self.cfg.data.reward)
        scored = time.perf_counter()
        self.decoder.learn_from_responses(prompts, out.token_ids, params.n)
        head_records, drafter_update = self.decoder.pop_head_records(), self.decoder.pop_drafter_update()
        return Rollouts(
            step=step,
            group_size=params.n,
            policy_version=policy_version,
            head_version=self.decoder.heads_version,
            prompt_indices=[i for i, _ in problems],
            prompt_ids=prompts,
            response_ids=out.token_ids,
            logprobs=out.logprobs,
            finish_reasons=out.finish_reasons,
            rewards=[score.reward for score in scores],
            correct=[score.correct for score in scores],
            engine_stats=[out.stats],
            head_records=[] if head_records is None else [head_records],
            drafter_updates=[] if drafter_update is None else [drafter_update],
            gen_s=generated - started,
            reward_s=scored - generated,
        )

    def evaluate(self, problems: list[tuple[int, Problem]], plan: EvalPlan) -> list[ProblemEval]:
        """One batch of held-out problems (each with its index in the held-out set), answered by the
        policy this replica holds; nothing of it reaches the heads or the step's telemetry."""
        use_threads(self.threads)
        return evaluate_problems(self.engine, self.tokenizer, problems, self.cfg.data.instruction,
                                 self.cfg.data.reward, plan)

    @torch.inference_mode()
    def response_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """Log-probs of given responses under this replica's policy at the rollout temperature
        (what the learner computes for them: the check that weights arrived)."""
        samples = GRPOSamples(prompt_ids, response_ids, torch.zeros(len(response_ids)))
        batch = pad_samples(samples, list(range(len(samples)))).to(next(self.model.parameters()).device)
        out = sequence_logprobs(self.model, batch.input_ids, batch.prompt_lens, batch.response_lens,
                                self.cfg.rollout.temperature)
        return [out.logprobs[row, : len(r)].float().cpu().tolist() for row, r in enumerate(response_ids)]
