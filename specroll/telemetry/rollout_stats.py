"""Metrics of one rollout step: from the engines' stats dicts and from the responses themselves.

Rollout actors each return `RolloutEngine.generate(...).stats` (plus, when speculating,
`SpeculativeDecoder.pop_stats`); these functions turn them into `speculation/*`, `perf/*` and `rollout/*`
metrics for all actors together. Pure functions of their inputs.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from . import metric_names as m


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def summarize_rollout_stats(stats: Mapping | Sequence[Mapping], head_version: int | None = None) -> dict[str, float]:
    """`perf/gen_tokens_per_s` and `speculation/*` metrics from the stats of one or more engines.

    Actors run in parallel, so throughput is all their tokens over the slowest one's wall time.
    Acceptance by depth is exact for one engine; over several it is weighted by each one's
    response-steps, as the stats carry rates, not the counts of drafts that reached a depth.
    """
    parts = [stats] if isinstance(stats, Mapping) else list(stats)
    if not parts:
        raise ValueError("no rollout stats to summarise")
    tokens = sum(s["tokens"] for s in parts)
    wall = max(s["wall_time_s"] for s in parts)
    out = {m.GEN_TOKENS_PER_S: tokens / wall if wall > 0 else 0.0}
    active = [rows for s in parts for rows in s["active_rows_per_step"]]
    if active:
        out[m.ACTIVE_ROWS_MEAN] = mean(active)
    if head_version is not None:
        out[m.HEAD_VERSION] = float(head_version)
    spec_parts = [s for s in parts if "verify_steps" in s]
    if not spec_parts:
        return out
    out[m.VERIFY_STEPS] = float(sum(s["verify_steps"] for s in spec_parts))
    hist: Counter = Counter()
    for s in spec_parts:
        hist.update(s["tokens_per_step_hist"])
    response_steps = sum(hist.values())
    if response_steps:
        out[m.TOKENS_PER_STEP] = sum(k * v for k, v in hist.items()) / response_steps
    drafted = sum(s["drafted_response_steps"] for s in spec_parts)
    if drafted:
        out[m.DRAFTED_TOKENS_PER_STEP] = sum(s["drafted_tokens"] for s in spec_parts) / drafted
    budgets = [b for s in spec_parts for b in s["budget_per_step"]]
    if budgets:
        out[m.NODE_BUDGET_MEAN] = mean(budgets)
    weights = [sum(s["tokens_per_step_hist"].values()) for s in spec_parts]
    if sum(weights):
        depths = max(len(s["acceptance_by_depth"]) for s in spec_parts)
        for d in range(depths):
            rates = [(s["acceptance_by_depth"][d], w) for s, w in zip(spec_parts, weights) if d < len(s["acceptance_by_depth"])]
            out[m.acceptance_depth(d + 1)] = sum(r * w for r, w in rates) / max(sum(w for _, w in rates), 1)
    if sum(weights):
        out[m.LOOKUP_TOKEN_SHARE] = sum(s["lookup_token_share"] * w for s, w in zip(spec_parts, weights)) / sum(weights)
    spent = sum(s["time_draft_s"] + s["time_verify_s"] + s["time_bookkeeping_s"] for s in spec_parts)
    if spent > 0:
        out[m.DRAFT_TIME_FRAC] = sum(s["time_draft_s"] for s in spec_parts) / spent
    reflex_parts = [s for s in spec_parts if "reflex_records" in s]
    if reflex_parts:
        out.update(reflex_metrics(reflex_parts, spent))
    return out


def reflex_metrics(parts: Sequence[Mapping], spent_s: float) -> dict[str, float]:
    """`speculation/reflex_*` of engines with Reflex on: rates weighted by verify passes, counts summed."""
    passes = [max(s["verify_steps"], 1) for s in parts]

    def weighted(name: str) -> float:
        return sum(s[name] * w for s, w in zip(parts, passes)) / sum(passes)

    out = {m.REFLEX_ON_FRAC: weighted("reflex_on_share"), m.REFLEX_RELIABILITY: weighted("reflex_reliability"),
           m.REFLEX_STATE_RMS: weighted("reflex_state_rms"),
           m.REFLEX_RECORDS: float(sum(s["reflex_records"] for s in parts)),
           m.REFLEX_RESETS: float(sum(s["reflex_resets"] for s in parts)),
           m.REFLEX_GUARD_TRIPS: float(sum(s["reflex_guard_trips"] for s in parts))}
    if spent_s > 0:
        out[m.REFLEX_TIME_FRAC] = sum(s["time_reflex_s"] for s in parts) / spent_s
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
