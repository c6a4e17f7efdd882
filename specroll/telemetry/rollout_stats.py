"""Metrics of one rollout step: from the engines' stats and from the responses themselves.

Rollout actors each return `RolloutEngine.generate(...).stats` (a `GenerationStats`, with a
tree decoder's `TreeStats`); these functions turn them into `speculation/*`, `perf/*` and
`rollout/*` metrics for all actors together. Pure functions of their inputs.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from specroll.rollout.stats import GenerationStats, ReflexStats, TreeStats

from . import metric_names as m


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def summarize_rollout_stats(stats: GenerationStats | Sequence[GenerationStats],
                            head_version: int | None = None) -> dict[str, float]:
    """`perf/gen_tokens_per_s` and `speculation/*` metrics from the stats of one or more engines.

    Actors run in parallel, so throughput is all their tokens over the slowest one's wall time.
    Acceptance by depth is exact for one engine; over several it is weighted by each one's
    response-steps, as the stats carry rates, not the counts of drafts that reached a depth.
    """
    parts = [stats] if isinstance(stats, GenerationStats) else list(stats)
    if not parts:
        raise ValueError("no rollout stats to summarise")
    tokens = sum(s.tokens for s in parts)
    wall = max(s.wall_time_s for s in parts)
    out = {m.GEN_TOKENS_PER_S: tokens / wall if wall > 0 else 0.0}
    active = [rows for s in parts for rows in s.active_rows_per_step]
    if active:
        out[m.ACTIVE_ROWS_MEAN] = mean(active)
    if head_version is not None:
        out[m.HEAD_VERSION] = float(head_version)
    trees = [s.tree for s in parts if s.tree is not None]
    if trees:
        out.update(tree_metrics(trees))
    return out


def tree_metrics(trees: Sequence[TreeStats]) -> dict[str, float]:
    """`speculation/*` of the engines with a tree decoder: counts summed, rates weighted by response-steps."""
    out = {m.VERIFY_STEPS: float(sum(t.verify_steps for t in trees))}
    hist: Counter = Counter()
    for t in trees:
        hist.update(t.tokens_per_step_hist)
    response_steps = sum(hist.values())
    if response_steps:
        out[m.TOKENS_PER_STEP] = sum(k * v for k, v in hist.items()) / response_steps
    drafted = sum(t.drafted_response_steps for t in trees)
    if drafted:
        out[m.DRAFTED_TOKENS_PER_STEP] = sum(t.drafted_tokens for t in trees) / drafted
    budgets = [b for t in trees for b in t.budget_per_step]
    if budgets:
        out[m.NODE_BUDGET_MEAN] = mean(budgets)
    weights = [sum(t.tokens_per_step_hist.values()) for t in trees]
    if sum(weights):
        depths = max(len(t.acceptance_by_depth) for t in trees)
        for d in range(depths):
            rates = [(t.acceptance_by_depth[d], w) for t, w in zip(trees, weights) if d < len(t.acceptance_by_depth)]
            out[m.acceptance_depth(d + 1)] = sum(r * w for r, w in rates) / max(sum(w for _, w in rates), 1)
    if sum(weights):
        out[m.LOOKUP_TOKEN_SHARE] = sum(t.lookup_token_share * w for t, w in zip(trees, weights)) / sum(weights)
    out.update(would_be_metrics(trees))
    spent = sum(t.time_draft_s + t.time_verify_s + t.time_bookkeeping_s for t in trees)
    if spent > 0:
        out[m.DRAFT_TIME_FRAC] = sum(t.time_draft_s for t in trees) / spent
    with_reflex = [t for t in trees if t.reflex is not None]
    if with_reflex:
        out.update(reflex_metrics([t.reflex for t in with_reflex], [t.verify_steps for t in with_reflex], spent))
    return out


def would_be_metrics(trees: Sequence[TreeStats]) -> dict[str, float]:
    """`speculation/would_be_*` and the tree step's cost of the engines that scored would-be trees
    (empty where none did): tokens per pass over all their trees, the cost weighted by them."""
    scored = [t for t in trees if t.would_be_passes]
    if not scored:
        return {}
    passes = sum(t.would_be_passes for t in scored)
    out = {m.WOULD_BE_TOKENS_PER_STEP: sum(t.would_be_tokens for t in scored) / passes,
           m.WOULD_BE_PASSES: float(passes), m.WOULD_BE_NODES: float(max(t.would_be_nodes for t in scored))}
    costed = [t for t in scored if t.tree_step_cost is not None]
    if costed:
        out[m.TREE_STEP_COST] = (sum(t.tree_step_cost * t.would_be_passes for t in costed)
                                 / sum(t.would_be_passes for t in costed))
    return out


def reflex_metrics(parts: Sequence[ReflexStats], verify_steps: Sequence[int], spent_s: float) -> dict[str, float]:
    """`speculation/reflex_*` of engines with Reflex on (each with its `verify_steps`): rates
    weighted by verify passes, counts summed."""
    passes = [max(steps, 1) for steps in verify_steps]

    def weighted(rates: list[float]) -> float:
        return sum(r * w for r, w in zip(rates, passes)) / sum(passes)

    out = {m.REFLEX_ON_FRAC: weighted([r.on_share for r in parts]),
           m.REFLEX_RELIABILITY: weighted([r.reliability for r in parts]),
           m.REFLEX_STATE_RMS: weighted([r.state_rms for r in parts]),
           m.REFLEX_RECORDS: float(sum(r.records for r in parts)),
           m.REFLEX_RESETS: float(sum(r.resets for r in parts)),
           m.REFLEX_GUARD_TRIPS: float(sum(r.guard_trips for r in parts))}
    if spent_s > 0:
        out[m.REFLEX_TIME_FRAC] = sum(r.time_s for r in parts) / spent_s
    return out


def drafter_update_metrics(updates: Sequence) -> dict[str, float]:
    """`timing_s/drafter_update` and `speculation/drafter_*` of the rollout actors' online drafter updates
    (`fastgrpo.online.DrafterUpdate`s); empty without any. Actors update in parallel: the slowest one's seconds."""
    if not updates:
        return {}
    return {m.TIME_DRAFTER_UPDATE: max(u.seconds for u in updates),
            m.DRAFTER_UPDATES: float(max(u.updates for u in updates)),
            m.DRAFTER_LOSS: mean([u.loss for u in updates])}


def response_metrics(
    lengths: Sequence[int],
    finish_reasons: Sequence[str],
    rewards: Sequence[float],
    correct: Sequence[bool] | None = None,
) -> dict[str, float]:
    """`rollout/*` metrics of the step's responses (token lengths, "stop"/"length", rewards)."""
    if not lengths or not (len(lengths) == len(finish_reasons) == len(rewards)):
        raise ValueError(
            f"need one length, finish reason and reward per response, got {len(lengths)}, "
            f"{len(finish_reasons)} and {len(rewards)}"
        )
    out = {
        m.RESPONSE_LENGTH_MEAN: mean(lengths),
        m.RESPONSE_LENGTH_MAX: float(max(lengths)),
        m.CLIP_RATIO: mean([reason == "length" for reason in finish_reasons]),
        m.REWARD_MEAN: mean(rewards),
    }
    if correct is not None:
        if len(correct) != len(lengths):
            raise ValueError(f"need one correctness flag per response, got {len(correct)} for {len(lengths)}")
        out[m.ACCURACY] = mean([bool(c) for c in correct])
    return out
