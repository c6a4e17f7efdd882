"""What a resume may change of the run it continues: every config field in one table, and the check
the driver makes before Ray starts.

A resumed launch's config is compared with the one its checkpoint was saved under (`state.json`'s
`config.run`; the run_dir's config.yaml for a checkpoint without one). Each field is one of:

- SAFE: how the run is watched, paced, placed or sped up (logging, evaluation, timeouts, total
  steps, checkpoint cadence, resources, speculation settings: speculative sampling is exact, so they
  change speed, never what is sampled). It goes through, with one line saying so.
- CHANGES_RUN: what the run learns from or how (data, sampling, group size, seed, optimizer, schedule
  and loss). Refused unless `resume_allow_changes` names it (or a section above it); then it takes
  effect, the optimizer's learning rate, betas, epsilon and weight decay included.
- FIXED: what the checkpoint's saved state is laid out for (ZeRO stage and precision, learner ranks,
  the draft heads' shape). Refused: no override can load the checkpoint otherwise.
- LAUNCH: names this launch rather than the run (resume, resume_allow_changes, run_dir). Not compared.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import yaml

from specroll.config_checks import require

SAFE, CHANGES_RUN, FIXED, LAUNCH = "safe", "changes the run", "fixed by the checkpoint", "this launch's"
ALLOW_FIELD = "resume_allow_changes"
CHECKPOINT_STATE = "state.json"  # specroll.learner.checkpoint.STATE_FILE, read here without a learner
RUN_CONFIG = "config.yaml"  # specroll.run_dir.CONFIG_NAME
log = logging.getLogger(__name__)


def kind(kind_of: str, section: str, names: str) -> dict[str, str]:
    return {f"{section}.{name}" if section else name: kind_of for name in names.split()}


# Every field of TrainConfig by dotted path (tests/test_config.py checks that none is missing).
RULES: dict[str, str] = {
    # The checkpoint's weights are trained on, read through model.name's tokenizer at model.dtype.
    **kind(CHANGES_RUN, "model", "name tokenizer dtype"),
    **kind(SAFE, "model", "device cache_dir"),
    **kind(CHANGES_RUN, "data", "name path subset split limit instruction prompts_per_step shuffle long_prompts"),
    **kind(CHANGES_RUN, "data.records", "question answer answer_format level_field levels"),
    **kind(CHANGES_RUN, "data.synthetic", "num_problems min_steps max_steps max_operand max_factor max_value "
                                          "operations seed"),
    **kind(CHANGES_RUN, "data.reward", "function correct format_weight"),
    **kind(SAFE, "data.reward", "timeout_s"),
    **kind(CHANGES_RUN, "rollout", "mode sampler temperature top_p top_k max_new_tokens n"),
    **kind(SAFE, "rollout", "compile sync_every"),
    **kind(FIXED, "rollout.speculation", "num_heads head_type"),  # the shape of the checkpoint's heads.pt
    **kind(SAFE, "rollout.speculation", "max_depth"),  # how deep trees draft: speed, never what is sampled
    **kind(SAFE, "rollout.speculation", "heads_path budget fixed_nodes would_be_every min_nodes max_nodes min_gain "
                                        "capacity sync_free_trees max_children max_frontier calibration_momentum "
                                        "context_lookup lookup_ngram head_drafts read_draws sibling_lookup history_lookup "
                                        "history_tokens_per_prompt history_tokens profile_cache_len adaptation "
                                        "records_per_rollout record_nodes"),
    **kind(SAFE, "rollout.speculation.reflex", "mode scale half_life_tokens eta norm_momentum feedback_clip reset_rms "
                                               "state_clip tv_floor tv_span horizon_decay coverage_weight sketch_size "
                                               "evidence_scale reliability_momentum reliability_threshold "
                                               "guard_baseline_rollouts guard_ratio guard_bad_in_a_row "
                                               "guard_off_rollouts"),
    **kind(SAFE, "rollout.speculation.drift", "calibration_steps check_every min_records z_threshold "
                                              "min_acceptance_drop consecutive cooldown_steps max_heads_per_event "
                                              "depth_buckets mad_floor signal"),
    **kind(SAFE, "rollout.speculation.consolidation", "replay_capacity max_policy_lag held_out_fraction lr steps "
                                                      "batch_records max_grad_norm distill_weight nll_weight "
                                                      "proximal_weight head_decay commit_ce_ratio wait"),
    **kind(SAFE, "rollout.fastgrpo", "drafter_path capacity max_nodes max_width min_depth max_depth depth_scale "
                                     "profile_cache_len"),
    **kind(SAFE, "rollout.fastgrpo.online", "enabled lr feature_weight ce_weight epochs batch_tokens chunk_tokens "
                                            "max_grad_norm"),
    **kind(FIXED, "learner", "zero_stage dtype"),  # the layout of the saved optimizer state
    **kind(CHANGES_RUN, "learner", "lr weight_decay betas adam_eps warmup_steps lr_schedule min_lr_ratio total_steps "
                                   "grad_clip ppo_epochs mini_batch_size max_response_len max_seq_len "
                                   "on_invalid_reward scale_advantages_by_std overlong_max_len overlong_buffer_len "
                                   "temperature use_reference seed"),
    # Memory, speed and waits: the same gradient.
    **kind(SAFE, "learner", "micro_batch_tokens activation_checkpointing device collective_timeout_s"),
    **kind(CHANGES_RUN, "learner.loss", "clip_low clip_high dual_clip log_ratio_clamp kl_coef kl_estimator "
                                        "aggregation mask_truncated importance_sampling_level surrogate "
                                        "cispo_weight_max mismatch_correction mismatch_weight_max "
                                        "mismatch_weight_min top_entropy_quantile"),
    **kind(FIXED, "cluster", "learner_world_size"),  # one saved state per learner rank
    **kind(CHANGES_RUN, "cluster", "overlap"),  # one step off-policy or not
    **kind(SAFE, "cluster", "num_rollout_actors cpus_per_rollout_actor gpus_per_rollout_actor cpus_per_learner "
                            "gpus_per_learner gpus_per_consolidation_actor ray_address remote_timeout_s phase_threads "
                            "master_port_range rollout_resources learner_resources consolidation_resources "
                            "weight_sync weight_sync_bucket_mb gpu_memory_gb"),
    **kind(SAFE, "logger", "backend mode project entity run_name jsonl console rollouts"),
    # Which groups a step trains on, and which prompts its extra rounds draw from the stream.
    **kind(CHANGES_RUN, "dynamic_sampling", "enabled target_groups round_prompts max_extra_rounds at_cap"),
    **kind(SAFE, "eval", "split path limit samples k batch_size seed before_training"),
    **kind(CHANGES_RUN, "", "seed"),
    **kind(SAFE, "", "total_steps checkpoint_every eval_every keep_last"),
    **kind(LAUNCH, "", f"resume {ALLOW_FIELD} run_dir"),
}
# Fields conf/ sets from another (`${...}`): a change to both is named once, and allowing the source allows both.
MIRRORS = {"learner.seed": "seed", "learner.temperature": "rollout.temperature"}


def check_allow_list(allowed: list[str]) -> None:
    """Each entry of `resume_allow_changes` must name a field or a section of the config that a resume may change."""
    for i, entry in enumerate(allowed):
        covered = [path for path in RULES if path == entry or path.startswith(entry + ".")]
        require(bool(covered), f"{ALLOW_FIELD}[{i}]", entry, "a config field or section")
        require(any(RULES[path] != FIXED for path in covered), f"{ALLOW_FIELD}[{i}]", entry,
                f"a field a resume may change, not one {FIXED}", why="the checkpoint cannot be loaded with another value")


def leaves(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted path -> value for each field of `values` (a config as plain containers)."""
    out = {}
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and path not in RULES:
            out.update(leaves(value, path + "."))
        else:
            out[path] = value
    return out


def is_allowed(path: str, allowed: list[str]) -> bool:
    return any(p == entry or p.startswith(entry + ".") for entry in allowed for p in (path, MIRRORS.get(path, "")))


def saved_run_config(checkpoint: Path, run_dir: Path) -> tuple[dict[str, Any] | None, str]:
    """The config `checkpoint` was saved under, and where it was read; None when neither record holds one."""
    state = json.loads((checkpoint / CHECKPOINT_STATE).read_text())
    saved = state.get("config", {}).get("run")
    if saved:
        return saved, str(checkpoint / CHECKPOINT_STATE)
    config = run_dir / RUN_CONFIG
    if checkpoint.parent.parent == run_dir and config.is_file():
        return yaml.safe_load(config.read_text()), str(config)
    return None, ""


def check_resume_changes(current: dict[str, Any], checkpoint: Path, run_dir: Path, allowed: list[str]) -> None:
    """Compare a resumed launch's config (`TrainConfig.to_dict()`) with its checkpoint's: log one line
    per change that goes through; raise `ValueError` listing every refused one with both values and
    what accepts it."""
    saved, source = saved_run_config(checkpoint, run_dir)
    if saved is None:
        log.warning("resume: %s records no config, so this launch's is not compared with it", checkpoint)
        return
    now, then = leaves(current), leaves(saved)
    changed = [path for path, value in now.items()
               if path in then and path in RULES and RULES[path] != LAUNCH and plain(then[path]) != plain(value)]
    refused = []
    for path in changed:
        rule, values = RULES[path], f"{then[path]!r} -> {now[path]!r}"
        if rule == SAFE or (rule == CHANGES_RUN and is_allowed(path, allowed)):
            why = "safe to change" if rule == SAFE else f"allowed by {ALLOW_FIELD}"
            log.info("resume: %s %s (%s)", path, values, why)
        elif MIRRORS.get(path) not in changed:
            refused.append(path)
    if not refused:
        return
    lines = []
    for path in refused:
        was = f"{path}: {then[path]!r} in the checkpoint, {now[path]!r} now"
        if RULES[path] == FIXED:
            lines.append(f"{was} ({FIXED}: no override loads it; keep the value or start a new run_dir)")
        else:
            lines.append(f"{was} (it {CHANGES_RUN}; to take it: {ALLOW_FIELD}=[{path}])")
    takeable = [p for p in refused if RULES[p] == CHANGES_RUN]
    accept = f"\n  to take every change that can be: {ALLOW_FIELD}=[{','.join(takeable)}]" if len(takeable) > 1 else ""
    raise ValueError(f"resume: this launch's config differs from {checkpoint}'s ({source}):\n  - "
                     + "\n  - ".join(lines) + accept)


def plain(value: Any) -> Any:
    """`value` as JSON keeps it (tuples become lists), so a saved value compares with a loaded one."""
    return json.loads(json.dumps(value, default=str))
