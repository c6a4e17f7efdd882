"""A step's rollouts, and how the step's prompts are split over rollout actors and learner ranks.

Prompts are split into contiguous runs of whole groups (a prompt and its `rollout.n`
responses never straddle two actors or ranks: GRPO advantages compare within a group).
Each prompt's random streams are named by (step, global prompt index) under the run seed,
so a response does not depend on which actor drew it or how many actors there are.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specroll.fastgrpo.online import DrafterUpdate
from specroll.rollout.stats import GenerationStats
from specroll.speculation.adaptation.head_records import HeadRecords


def split_groups(num_prompts: int, parts: int) -> list[range]:
    """Contiguous ranges of prompt indices, one per part, sizes differing by at most one.

    The first `num_prompts % parts` parts take one prompt more.
    """
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be an int >= 1, got {parts!r}")
    if num_prompts < parts:
        raise ValueError(f"{num_prompts} prompts cannot be split into {parts} non-empty parts")
    base, extra = divmod(num_prompts, parts)
    ranges, start = [], 0
    for part in range(parts):
        size = base + (part < extra)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def prompt_key(step: int, index: int) -> tuple[int, int]:
    """The name of prompt `index` (in the step's whole batch) of step `step` in the random streams."""
    return (step, index)


@dataclass
class Rollouts:
    """Responses to consecutive prompts of one step.

    Per prompt: its index in the step's batch and its token ids. Per response (prompt-major,
    `group_size` per prompt): its tokens, their log-probs under the distribution they were
    sampled from, finish reason ("stop" / "length"), reward and correctness.
    """

    step: int
    group_size: int
    policy_version: int  # of the weights that generated every response here
    head_version: int | None  # of the draft heads; None for vanilla decoding
    prompt_indices: list[int]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    rewards: list[float]
    correct: list[bool]
    engine_stats: list[GenerationStats] = field(default_factory=list)  # `RolloutEngine.generate` stats, one per actor
    head_records: list[HeadRecords] = field(default_factory=list)  # slow path: each actor's, for consolidation
    drafter_updates: list[DrafterUpdate] = field(default_factory=list)  # rollout=fastgrpo: each actor's online update
    gen_s: float = 0.0  # slowest actor's generation time
    reward_s: float = 0.0  # slowest actor's scoring time

    def __len__(self) -> int:
        return len(self.prompt_indices)

    @classmethod
    def concat(cls, parts: list["Rollouts"]) -> "Rollouts":
        """The parts of one step, in prompt order. Parts of different policy versions are refused:
        a step's responses come from one policy."""
        if not parts:
            raise ValueError("no rollouts to concatenate")
        parts = sorted(parts, key=lambda p: p.prompt_indices[0])
        first = parts[0]
        versions = {p.policy_version for p in parts}
        if len(versions) > 1:
            raise ValueError(f"rollouts of step {first.step} come from policy versions {sorted(versions)}; expected one")
        if {p.step for p in parts} != {first.step} or {p.group_size for p in parts} != {first.group_size}:
            raise ValueError("rollouts of different steps or group sizes cannot be concatenated")
        heads = [p.head_version for p in parts if p.head_version is not None]

        def joined(name: str) -> list:
            return [item for p in parts for item in getattr(p, name)]

        return cls(
            step=first.step,
            group_size=first.group_size,
            policy_version=first.policy_version,
            # Heads change the speed, never the samples' distribution; report the oldest in use.
            head_version=min(heads) if heads else None,
            prompt_indices=joined("prompt_indices"),
            prompt_ids=joined("prompt_ids"),
            response_ids=joined("response_ids"),
            logprobs=joined("logprobs"),
            finish_reasons=joined("finish_reasons"),
            rewards=joined("rewards"),
            correct=joined("correct"),
            engine_stats=joined("engine_stats"),
            head_records=joined("head_records"),
            drafter_updates=joined("drafter_updates"),
            gen_s=max(p.gen_s for p in parts),
            reward_s=max(p.reward_s for p in parts),
        )

    def select(self, prompts: range) -> "Rollouts":
        """The prompts at positions `prompts` of this batch, with their whole groups."""
        n = self.group_size
        responses = slice(prompts.start * n, prompts.stop * n)
        return Rollouts(
            step=self.step,
            group_size=n,
            policy_version=self.policy_version,
            head_version=self.head_version,
            prompt_indices=self.prompt_indices[prompts.start : prompts.stop],
            prompt_ids=self.prompt_ids[prompts.start : prompts.stop],
            response_ids=self.response_ids[responses],
            logprobs=self.logprobs[responses],
            finish_reasons=self.finish_reasons[responses],
            rewards=self.rewards[responses],
            correct=self.correct[responses],
        )

    def prompt_ids_per_response(self) -> list[list[int]]:
        return [ids for ids in self.prompt_ids for _ in range(self.group_size)]

    def truncated(self) -> list[bool]:
        return [reason == "length" for reason in self.finish_reasons]
