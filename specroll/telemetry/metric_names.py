"""The stable namespace of metric names: every metric SpecRoll logs is defined here, once.

Seven families: `rollout/*` (the step's responses), `speculation/*` (speculative decoding),
`perf/*` (throughput), `timing_s/*` (seconds per phase of a step), `train/*` (the learner's
update, emitted by `GRPOLearner.update`, and the step itself), `heads/*` (draft-head consolidation)
and `eval/*` (the held-out evaluation, on the steps `eval_every` names). A name
not defined here is refused by `check_metric_name`: add it here, with its meaning, first.
Unless stated otherwise a value describes one training step.
"""
from __future__ import annotations

import difflib
import re

FAMILIES = ("rollout", "speculation", "perf", "timing_s", "train", "heads", "eval")

METRICS: dict[str, str] = {}  # name -> what it measures
TEMPLATES: dict[str, str] = {}  # name with one "{d}" (a positive int) -> what it measures


def metric(name: str, description: str) -> str:
    family = name.split("/", 1)[0]
    if family not in FAMILIES:
        raise ValueError(f"metric family {family!r} of {name!r} is not one of {FAMILIES}")
    (TEMPLATES if "{d}" in name else METRICS)[name] = description
    return name


# rollout/*: the responses of the step (all rollout actors together).
RESPONSE_LENGTH_MEAN = metric("rollout/response_length_mean", "mean response length, tokens")
RESPONSE_LENGTH_MAX = metric("rollout/response_length_max", "longest response, tokens")
CLIP_RATIO = metric("rollout/clip_ratio", "share of responses cut at rollout.max_new_tokens")
REWARD_MEAN = metric("rollout/reward_mean", "mean reward over responses")
ACCURACY = metric("rollout/accuracy", "share of responses whose final answer is correct")
ROLLOUT_POLICY_VERSION = metric("rollout/policy_version",
                                "policy version that sampled the responses (one behind train/* with cluster.overlap)")
RESAMPLE_ROUNDS = metric("rollout/resample_rounds", "extra sampling rounds dynamic sampling took to fill the batch")
RESAMPLED_GROUPS = metric("rollout/resampled_groups", "groups drawn by dynamic sampling's extra rounds")
KEPT_GROUPS = metric("rollout/kept_groups", "groups with reward signal the step trains on (dynamic sampling)")
DROPPED_GROUPS = metric("rollout/dropped_groups", "groups drawn but not trained on: no reward signal, or past the target")

# speculation/*: speculative decoding, from the rollout engine's stats.
TOKENS_PER_STEP = metric("speculation/tokens_per_step", "tokens kept per response per verify pass (1 = no gain; none past a stop token or the cap)")
DRAFTED_TOKENS_PER_STEP = metric("speculation/drafted_tokens_per_step",
                                 "tokens kept per response per verify pass, over the passes that drafted a tree")
ACCEPTANCE_DEPTH = metric("speculation/acceptance_depth_{d}", "share of drafts accepted at tree depth d among those that reached it")
NODE_BUDGET_MEAN = metric("speculation/node_budget_mean", "mean tree nodes per response (root included) over verify passes")
ACTIVE_ROWS_MEAN = metric("speculation/active_rows_mean", "mean unfinished responses per decode step of an actor (both modes)")
VERIFY_STEPS = metric("speculation/verify_steps", "verify passes, summed over rollout actors")
LOOKUP_TOKEN_SHARE = metric("speculation/lookup_token_share", "share of accepted drafts that context lookup proposed (some also by the heads)")
WOULD_BE_TOKENS_PER_STEP = metric("speculation/would_be_tokens_per_step",
                                  "tokens per verify pass that would-be trees, scored while decoding plain, would have emitted")
WOULD_BE_PASSES = metric("speculation/would_be_passes", "would-be trees scored to the end, summed over rollout actors")
WOULD_BE_NODES = metric("speculation/would_be_nodes", "nodes per response (root included) of the would-be trees")
TREE_STEP_COST = metric("speculation/tree_step_cost",
                        "what a step with would-be-sized trees costs, in plain steps, by the hardware profile")
DRAFT_TIME_FRAC = metric("speculation/draft_time_frac", "share of speculative step time spent drafting trees")
HEAD_VERSION = metric("speculation/head_version", "version of the draft heads the rollout actors used")
REFLEX_ON_FRAC = metric("speculation/reflex_on_frac", "share of verify passes whose drafts carried a Reflex correction")
REFLEX_RELIABILITY = metric("speculation/reflex_reliability", "mean Reflex reliability (cosine of predicted and new feedback)")
REFLEX_STATE_RMS = metric("speculation/reflex_state_rms", "mean RMS of the responses' Reflex fast states")
REFLEX_RECORDS = metric("speculation/reflex_records", "draft records that matured into Reflex feedback, all actors")
REFLEX_RESETS = metric("speculation/reflex_resets", "Reflex fast states reset by a feedback blow-up, all actors")
REFLEX_GUARD_TRIPS = metric("speculation/reflex_guard_trips", "times the guard switched Reflex off since the run began, summed over actors")
REFLEX_TIME_FRAC = metric("speculation/reflex_time_frac", "share of speculative step time spent on Reflex feedback")
DRAFTER_UPDATES = metric("speculation/drafter_updates", "online updates of the FastGRPO-style drafter since pretraining (rollout=fastgrpo)")
DRAFTER_LOSS = metric("speculation/drafter_loss", "FastGRPO-style drafter's training loss in the step's online update, mean over actors")

# perf/*: throughput.
GEN_TOKENS_PER_S = metric("perf/gen_tokens_per_s", "response tokens generated per second, all rollout actors together")
TRAIN_TOKENS_PER_S = metric("perf/train_tokens_per_s", "prompt + response tokens trained on per second of update")
STEP_TIME_S = metric("perf/step_time_s", "wall-clock seconds of the whole training step, with the checkpoint saved after the one before")

# timing_s/*: seconds spent in each phase of the step, as the driver sees them.
TIME_GEN = metric("timing_s/gen", "generating responses (dynamic sampling's extra rounds: timing_s/resample)")
TIME_REWARD = metric("timing_s/reward", "scoring responses (dynamic sampling's extra rounds: timing_s/resample)")
TIME_OLD_LOGPROB = metric("timing_s/old_logprob", "separate pass scoring the responses under the policy before the "
                          "update (0 with one epoch of one mini-batch: the update's forward gives them)")
TIME_UPDATE = metric("timing_s/update", "the learner's update (all epochs and mini-batches)")
TIME_WEIGHT_SYNC = metric("timing_s/weight_sync", "sending new policy weights to the rollout actors")
TIME_HEAD_SYNC = metric("timing_s/head_sync", "sending new draft-head weights to the rollout actors")
TIME_RESAMPLE = metric("timing_s/resample", "dynamic sampling's extra rounds: drawing, generating and scoring more groups")
TIME_CHECKPOINT = metric("timing_s/checkpoint", "saving the checkpoint after the previous step, whose line comes first (0 without one)")
TIME_EVAL = metric("timing_s/eval", "evaluating the policy on the held-out problems (0 on steps without one)")
TIME_DRAFTER_UPDATE = metric("timing_s/drafter_update",
                             "online FastGRPO-style drafter learning in the rollout actors, in the step (slowest actor)")

# train/*: `GRPOLearner.update`; per-token values are means over valid response tokens.
STEP = metric("train/step", "the training step (0-based): the x-axis W&B draws every metric against")
LOSS = metric("train/loss", "total loss per optimizer step (policy loss + KL penalty)")
PG_LOSS = metric("train/pg_loss", "clipped policy-gradient loss per optimizer step")
CLIP_FRAC_LOW = metric("train/clip_frac_low", "share of tokens clipped at ratio 1 - clip_low")
CLIP_FRAC_HIGH = metric("train/clip_frac_high", "share of tokens clipped at ratio 1 + clip_high")
DUAL_CLIP_FRAC = metric("train/dual_clip_frac", "share of tokens capped by the dual clip")
APPROX_KL = metric("train/approx_kl", "KL estimate between the updated and the sampling policy")
KL_REF = metric("train/kl_ref", "KL estimate between the policy and the reference policy")
ENTROPY = metric("train/entropy", "policy entropy per response token")
CISPO_CLIP_FRAC = metric("train/cispo_clip_frac", "share of tokens whose CISPO weight is capped at loss.cispo_weight_max")
IS_WEIGHT_MEAN = metric("train/is_weight_mean", "mean rollout-learner mismatch weight per token (loss.mismatch_correction)")
IS_CLIPPED_FRAC = metric("train/is_clipped_frac", "share of tokens whose mismatch weight was truncated or masked")
ENTROPY_MASK_FRAC = metric("train/entropy_mask_frac", "share of tokens the policy gradient acts on (loss.top_entropy_quantile)")
OVERLONG_PENALTY_MEAN = metric("train/overlong_penalty_mean", "mean soft overlong penalty added to the rewards")
GRAD_NORM = metric("train/grad_norm", "global gradient norm before clipping, mean over optimizer steps")
LR = metric("train/lr", "learning rate, mean over optimizer steps")
FRAC_ZERO_STD_GROUPS = metric("train/frac_zero_std_groups", "share of groups whose rewards are all equal (no signal)")
OPTIMIZER_STEPS = metric("train/optimizer_steps", "optimizer steps taken in the update")
STEP_SKIPPED = metric("train/step_skipped", "1 when dynamic sampling skipped the step's update at its cap, else 0")
SKIPPED_STEPS = metric("train/skipped_steps", "mini-batches with no valid token (e.g. all truncated and masked): no optimizer step")
POLICY_VERSION = metric("train/policy_version", "optimizer steps since the start of the run")
NUM_SEQUENCES = metric("train/num_sequences", "responses trained on")
RESPONSE_TOKENS = metric("train/response_tokens", "response tokens trained on")
RESPONSE_LEN_MEAN = metric("train/response_len_mean", "mean length of the responses trained on, tokens")
TRUNCATED_FRAC = metric("train/truncated_frac", "share of responses trained on that hit the length cap")
SKIPPED_INVALID_REWARD = metric("train/skipped_invalid_reward", "responses dropped for a non-finite reward")
PADDING_FRAC = metric("train/padding_frac", "share of padded tokens in the micro-batches")

# heads/*: the head-consolidation actor.
HEADS_VERSION = metric("heads/version", "version of the newest published draft heads")
HEADS_UPDATES = metric("heads/updates", "head-only updates run since the start of the run")
HEADS_LOSS = metric("heads/loss", "draft-head training loss of the latest update")
HEADS_UPDATE_S = metric("heads/update_s", "seconds of head-only updates in the step (overlapping the learner unless waited for)")
HEADS_UPDATE_WAIT_S = metric("heads/update_wait_s", "seconds the driver waited for the step's head update beyond the learner")
HEADS_DRIFT_Z_MAX = metric("heads/drift_z_max", "largest robust TV z of a draft head at the step's drift check (absent without one)")
HEADS_DRIFT_TRIGGERS = metric("heads/drift_triggers", "drift events (head updates asked for) since the start of the run")
HEADS_REPLAY_RECORDS = metric("heads/replay_records", "matured draft records in the replay memory at the end of the step")
HEADS_REPLAY_DROPPED = metric("heads/replay_dropped", "matured records evicted by the replay cap since the start of the run")

# eval/*: the policy after the step's update on the held-out problems (`eval_every`; absent on other steps).
EVAL_ACCURACY = metric("eval/accuracy", "share of held-out problems whose greedy response is correct")
EVAL_REWARD_MEAN = metric("eval/reward_mean", "mean reward of the greedy responses to the held-out problems")
EVAL_RESPONSE_LENGTH_MEAN = metric("eval/response_length_mean", "mean greedy response length on the held-out problems, tokens")
EVAL_PROBLEMS = metric("eval/problems", "held-out problems evaluated")
EVAL_PASS_AT_K = metric("eval/pass_at_{d}", "unbiased pass@k over eval.samples sampled responses per held-out problem")

_TEMPLATE_PATTERNS = {re.compile(re.escape(t).replace(re.escape("{d}"), "[1-9][0-9]*") + "$"): t for t in TEMPLATES}


def acceptance_depth(depth: int) -> str:
    """`speculation/acceptance_depth_{d}` for tree depth `depth` (1 = the first drafted token)."""
    if depth < 1:
        raise ValueError(f"tree depth must be >= 1, got {depth}")
    return ACCEPTANCE_DEPTH.format(d=depth)


def pass_at(k: int) -> str:
    """`eval/pass_at_{d}` for pass@`k`."""
    if k < 1:
        raise ValueError(f"pass@k needs k >= 1, got {k}")
    return EVAL_PASS_AT_K.format(d=k)


def family_names(family: str) -> tuple[str, ...]:
    """The fixed names of one family, in the order defined here (templates left out)."""
    if family not in FAMILIES:
        raise ValueError(f"metric family {family!r} is not one of {FAMILIES}")
    return tuple(name for name in METRICS if name.split("/", 1)[0] == family)


def is_metric_name(name: str) -> bool:
    return name in METRICS or any(p.match(name) for p in _TEMPLATE_PATTERNS)


def check_metric_name(name: str) -> None:
    """Raise `ValueError` for a name outside the namespace, suggesting the nearest names."""
    if is_metric_name(name):
        return
    near = difflib.get_close_matches(name, [*METRICS, *TEMPLATES], n=3)
    hint = f"; did you mean {', '.join(near)}?" if near else ""
    raise ValueError(
        f"metric {name!r} is not in the namespace of specroll/telemetry/metric_names.py "
        f"(families {', '.join(f + '/*' for f in FAMILIES)}): define it there first{hint}"
    )


# Families renamed since a run may have been logged: metrics.jsonl files of earlier runs read
# back under the current names (docs/guide.md, Changelog).
RENAMED_FAMILIES = {"spec/": "speculation/"}  # before 2026-12-06


def current_name(name: str) -> str:
    """`name` as the namespace spells it now (a name logged under a renamed family is translated)."""
    for old, new in RENAMED_FAMILIES.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name
