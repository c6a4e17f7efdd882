"""DAPO's dynamic sampling: a step trains only on groups whose rewards differ, refilled within the step.

A group whose `rollout.n` rewards are all equal has zero advantage: it adds no policy gradient, only
weight to the loss's denominator. With `dynamic_sampling.enabled` the driver drops such groups and
draws more prompts from the prompt stream for the rollout actors (speculative like every rollout),
round after round, until the batch holds its target of groups with signal or the cap of extra rounds
is reached; then it trains on what it has, or skips the step (DAPO, arXiv:2503.14476, section 3.2;
verl's `algorithm.filter_groups`). Prompts come from the stream in order and the decisions depend on
rewards alone, so a speculative run and its `rollout=vanilla` twin draw and keep the same groups.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

from specroll.actors import Rollouts
from specroll.configs import DynamicSamplingConfig
from specroll.telemetry import metric_names as m

def groups_with_signal(rewards: list[float], group_size: int) -> list[bool]:
    """Per group of `group_size` consecutive rewards: whether any two differ (a non-finite reward
    differs from all, and is left to the learner's `on_invalid_reward`)."""
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not form groups of {group_size}")
    groups = [rewards[i : i + group_size] for i in range(0, len(rewards), group_size)]
    return [any(r != group[0] for r in group) for group in groups]


class RoundOutcome(NamedTuple):
    """What a step does after a sampling round."""

    sample_more: int  # prompts the next round draws; 0: no more rounds
    keep: int  # groups with signal it trains on (the first ones drawn), once no more rounds are due
    skip: bool  # no update this step


def decide(kept: int, target: int, rounds_done: int, cfg: DynamicSamplingConfig, ranks: int) -> RoundOutcome:
    """After `rounds_done` extra rounds with `kept` groups with signal: sample again, or train on the
    first `target` of them, or, at the cap, on as many as the `ranks` learner ranks share equally
    (`at_cap=train`), or skip the step (`at_cap=skip`, or none to share)."""
    if kept >= target:
        return RoundOutcome(0, target, False)
    if rounds_done < cfg.max_extra_rounds:
        return RoundOutcome(cfg.round_prompts or target - kept, 0, False)
    keep = kept - kept % ranks if cfg.at_cap == "train" else 0
    return RoundOutcome(0, keep, keep == 0)


class FilledBatch(NamedTuple):
    """A step's groups with signal, and how many rounds and groups it took."""

    # the groups trained on (a skipped step's: every group drawn, for its rollout/* and log), in draw
    # order, with the first round's engine telemetry and every round's head records
    rollouts: Rollouts
    skip: bool  # no update this step
    metrics: dict[str, float]  # rollout/resample_rounds, rollout/resampled_groups, rollout/kept_groups, ...


def fill_batch(first: Rollouts, target: int, cfg: DynamicSamplingConfig, ranks: int,
               sample: Callable[[int, int], Rollouts], clock: Callable[[], float]) -> FilledBatch:
    """Drop `first`'s groups without signal and call `sample(first_index, count)` for rounds of
    `count` new prompts (indexed in the step after those drawn) until `decide` says stop."""
    rounds, started = [first], clock()
    while True:
        kept = [(r, g) for r in rounds for g, ok in enumerate(groups_with_signal(r.rewards, r.group_size)) if ok]
        decision = decide(len(kept), target, len(rounds) - 1, cfg, ranks)
        if not decision.sample_more:
            break
        rounds.append(sample(sum(len(r) for r in rounds), decision.sample_more))
    drawn, extra = sum(len(r) for r in rounds), len(rounds) - 1
    groups = rounds if decision.skip else [r.select(range(g, g + 1)) for r, g in kept[: decision.keep]]
    # Engine stats and times stay the first round's (stats of parallel shards, phases that stack with
    # timing_s/resample); the slow path learns from every round's drafts.
    rollouts = replace(Rollouts.concat(groups), engine_stats=first.engine_stats, drafter_updates=first.drafter_updates,
                       head_records=[h for r in rounds for h in r.head_records], gen_s=first.gen_s,
                       reward_s=first.reward_s)
    metrics = {m.RESAMPLE_ROUNDS: float(extra), m.RESAMPLED_GROUPS: float(drawn - len(first)),
               m.KEPT_GROUPS: float(decision.keep), m.DROPPED_GROUPS: float(drawn - decision.keep),
               m.STEP_SKIPPED: float(decision.skip), m.TIME_RESAMPLE: clock() - started if extra else 0.0}
    return FilledBatch(rollouts, decision.skip, metrics)
