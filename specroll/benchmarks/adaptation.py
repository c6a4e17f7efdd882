"""Drafter adaptation modes side by side on a controlled policy drift (docs/algorithm.md, sections 5, 6, 9).

A run is R rounds; a round stands for one training step: fresh prompts, one generate call per
mode, all modes on the same prompts and seeds. The policy is A for the first `--drift-at`
rounds (the drift detector calibrates there, and the heads, trained for A, fit) and B after
(the drift), swapped in place as a rollout actor's `load_policy` does, so every decoder's
state carries over as in a training run. Modes: static, reflex, slow, both, every_step
(`rollout.speculation.adaptation`), plus plain decoding on the same prompts for the speed ratio, and
with `--heads-b` a ceiling: static heads that switch at the drift to heads fit for B, so the
table shows how much of the drift's cost each mode wins back.
Slow-path modes hand each round's records to their own `HeadConsolidator` after the round
and draft with committed heads from the next round on. The update runs between rounds here;
in a training run it overlaps the learner, so its seconds are reported apart, not in generation time.
Every mode samples plain decoding's responses for the same seed (speculation/verification/verify.py), so the modes
differ only in what they drafted for the same responses; the share of responses identical to
vanilla's is checked and printed (a float rounding flip may fork a response).

    python -m specroll.benchmarks.adaptation [--quick] [--policy-a smollm2-135m-instruct --heads shipped]
        [--policy-b DIR] [--modes static reflex slow both every_step]
        [--rounds 12 --drift-at 4] [--head-lr 3e-4 --head-steps 30] [--heads-b FILE] [--threads 1] [--seeds 4]
        [--json out.json] [--plot out.png]

Without --policy-b, B is policy A after a short SFT on synthetic worked solutions, made on the
first run and cached (drifted_policy.py; on a shared 2-core CPU `--quick` took 6.2 min in all, B's SFT step 39 s).
The reverse drift (heads trained for the SFT'd policy drafting for the instruct one):
    --policy-a ~/.cache/specroll/sft/gsm8k800 --heads <heads file for it> --policy-b smollm2-135m-instruct
        --heads-b shipped
Tiny stand-ins (tests, smoke runs; B is A with its last layer and LM head perturbed): --tiny
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specroll.speculation import DriftConfig, HorizonHeads, SpeculationConfig, SpeculativeDecoder, shipped_heads
from specroll.speculation.adaptation.consolidation import ConsolidationConfig, HeadConsolidator
from specroll.speculation.adaptation.drift_detector import DRIFT_SIGNALS
from specroll.speculation.adaptation.head_records import RECORD_NODES
from specroll.speculation.adaptation.reflex import REFLEX_MODES, ReflexConfig
from specroll.speculation.config import ADAPTATION_MODES
from specroll.speculation.drafting.heads import model_fingerprint

from ..models import build_tiny_model, load_causal_lm, synchronize
from ..rollout import GenerationStats, RolloutEngine, SamplingParams
from .drifted_policy import SKIPPED_PROBLEMS, build_drifted_policy
from .engine_vs_hf import load_prompts
from .flags import add_machine_flags, fill_sizes
from .grpo_steps import GSM8K_TRAIN

VANILLA = "vanilla"  # plain decoding, the speed reference
CEILING = "ceiling"  # static heads, swapped at the drift for heads fit for policy B
# Run sizes: a full run, and --quick (under 10 minutes with SmolLM2 on a 2-core CPU).
SIZES = {"full": dict(rounds=12, prompts=4, n=4, max_new_tokens=128),
         "quick": dict(rounds=10, prompts=2, n=2, max_new_tokens=48)}
DROPPED_STATS = ("budget_per_step", "active_rows_per_step")  # per-step lists: the JSON keeps their means
TINY_VOCAB = 64


@dataclass
class Scenario:
    """The drift: a policy (holding A's weights at first), B's weights, heads fit for A, prompts per round."""

    model: torch.nn.Module
    policy_b: dict[str, torch.Tensor]
    heads: HorizonHeads
    rounds: list[tuple[list[int], list[list[int]]]]  # per round: (prompt indices, prompt token ids)
    description: str  # "A ... -> B ...": the plot's title
    prompt_source: str
    heads_b: HorizonHeads | None = None  # heads fit for B (the ceiling's), if given


@dataclass
class Arm:
    """One way of drafting (or vanilla), with its own engine and decoder state over the shared policy."""

    mode: str
    engine: RolloutEngine
    consolidator: HeadConsolidator | None = None


# -- the scenario -------------------------------------------------------------------------------

def load_heads(spec: str, policy_name: str, model, flag: str = "--heads") -> HorizonHeads:
    """'shipped' (SpecRoll's heads for `policy_name`), 'untrained', or a heads file."""
    if spec == "untrained":
        return HorizonHeads.for_model(model, "path", 4)
    if spec == "shipped":
        try:
            spec = str(shipped_heads(policy_name))
        except ValueError as exc:
            raise ValueError(f"{exc}; pass {flag} FILE (heads trained for {policy_name})") from None
    return HorizonHeads.load(spec, model)


def real_scenario(args) -> Scenario:
    model, tokenizer = load_causal_lm(args.policy_a, dtype=args.dtype, device=args.device)
    heads = load_heads(args.heads, args.policy_a, model)
    path = Path(args.policy_b).expanduser()
    b, _ = load_causal_lm(str(path) if path.exists() else args.policy_b, dtype=args.dtype, device=args.device)
    if model_fingerprint(b.config) != model_fingerprint(model.config):
        raise ValueError(f"policy B ({model_fingerprint(b.config)}) is not the architecture of policy A "
                         f"({model_fingerprint(model.config)}): heads cannot carry over")
    heads_b = None if args.heads_b is None else load_heads(args.heads_b, args.policy_b, b, "--heads-b")
    prompts, source = load_prompts(tokenizer, args.rounds * args.prompts, Path(args.data_path).expanduser())
    return Scenario(model, b.state_dict(), heads, split_rounds(prompts, args.prompts),
                    f"A {args.policy_a} (heads {args.heads}) -> B {args.policy_b}", source, heads_b)


def split_rounds(prompts: list[list[int]], per_round: int) -> list[tuple[list[int], list[list[int]]]]:
    """Consecutive, disjoint prompts per round: every round has fresh ones."""
    return [(list(range(i, i + per_round)), prompts[i : i + per_round]) for i in range(0, len(prompts), per_round)]


def tiny_scenario(args) -> Scenario:
    """A: a random 2-layer model with peaky distributions and heads trained for it here; B: A with
    its last layer and LM head perturbed by Gaussian noise of std `--tiny-drift`."""
    model = build_tiny_model(vocab_size=TINY_VOCAB, init_std=0.15, seed=3).requires_grad_(False)
    g = torch.Generator().manual_seed(args.seed)
    heads = tiny_heads(model, random_prompts(g, 8))
    b = {k: v.clone() for k, v in model.state_dict().items()}
    for name, p in b.items():
        if name.startswith(("layers.1.", "lm_head")):
            p.add_(torch.randn(p.shape, generator=g) * args.tiny_drift)
    heads_b = None
    if args.heads_b is not None:  # trained here for B, on a copy of the model holding B's weights
        model_b = copy.deepcopy(model)
        model_b.load_state_dict(b)
        heads_b = tiny_heads(model_b, random_prompts(g, 8))
    prompts = random_prompts(g, args.rounds * args.prompts)
    return Scenario(model, b, heads, split_rounds(prompts, args.prompts),
                    f"A tiny-llama (heads trained here) -> B A + noise {args.tiny_drift} on its last layer and LM head",
                    "random tokens", heads_b)


def tiny_heads(model, prompts: list[list[int]], positions: int = 2000, epochs: int = 3) -> HorizonHeads:
    """Path heads trained here on the tiny model's own samples for `prompts`."""
    from specroll.speculation.head_training.samples import SampleConfig, collect_samples
    from specroll.speculation.head_training.training import HeadTrainConfig, train_heads

    heads = HorizonHeads.for_model(model, "path", 4)
    with tempfile.TemporaryDirectory() as cache:
        samples = collect_samples(model, prompts, SampleConfig(positions=positions, prompts_per_batch=8,
                                                               samples_per_prompt=8, max_new_tokens=24),
                                  cache, progress=False)
    train_heads(model, heads, samples.sequences, HeadTrainConfig(epochs=epochs, lr=3e-3, batch_positions=256),
                progress=False, log=lambda _: None)
    return heads


def random_prompts(g: torch.Generator, count: int) -> list[list[int]]:
    """Prompts of 2-5 random tokens, never EOS (id 1) or 0."""
    lengths = torch.randint(2, 6, (count,), generator=g).tolist()
    return [torch.randint(2, TINY_VOCAB, (n,), generator=g).tolist() for n in lengths]


# -- the arms -----------------------------------------------------------------------------------

def build_arms(scenario: Scenario, args) -> list[Arm]:
    arms = [Arm(VANILLA, RolloutEngine(scenario.model))]
    drift = DriftConfig(calibration_steps=args.calibration_steps, check_every=args.check_every,
                        min_records=args.min_records, consecutive=args.consecutive, z_threshold=args.z_threshold,
                        min_acceptance_drop=args.min_acceptance_drop, signal=args.drift_signal,
                        cooldown_steps=args.cooldown_steps, max_heads_per_event=args.max_heads_per_event)
    consolidation = ConsolidationConfig(lr=args.head_lr, steps=args.head_steps, replay_capacity=args.replay_capacity,
                                        batch_records=args.batch_records)
    modes = args.modes + ([CEILING] if scenario.heads_b is not None else [])
    for mode in modes:
        heads = scenario.heads
        spec = SpeculationConfig(head_type=heads.head_type, num_heads=heads.num_heads, heads_path=None, budget=args.budget,
                          fixed_nodes=args.nodes, max_nodes=max(args.max_nodes, args.nodes),
                          adaptation="static" if mode == CEILING else mode,
                          reflex=ReflexConfig(mode=args.reflex_mode, scale=args.reflex_scale),
                          records_per_rollout=args.records_per_rollout,
                          record_nodes=args.record_nodes, drift=drift, consolidation=consolidation)
        engine = RolloutEngine(scenario.model, decoder=SpeculativeDecoder(scenario.model, spec))
        engine.decoder.set_heads(copy.deepcopy(heads))  # every mode starts from the same heads
        consolidator = HeadConsolidator(heads, mode, drift, consolidation) if spec.uses_slow_path else None
        arms.append(Arm(mode, engine, consolidator))
    return arms


def run_arm(arm: Arm, model, prompts: list[list[int]], params: SamplingParams, round_index: int,
            policy_version: int) -> tuple[dict, list[list[int]]]:
    """One generate call, then (slow-path modes) the consolidation step a training run would take:
    the round's figures and the responses."""
    device = next(model.parameters()).device
    head_version = arm.engine.decoder.heads.version if arm.mode != VANILLA else None
    synchronize(device)
    started = time.perf_counter()
    out = arm.engine.generate(prompts, params)
    synchronize(device)
    gen_s = time.perf_counter() - started
    stats = {k: v for k, v in stats_row(out.stats).items() if k not in DROPPED_STATS}
    budgets = out.stats.tree.budget_per_step if out.stats.tree is not None else None
    row = stats | {"gen_s": gen_s, "tokens_per_s": out.stats.tokens / gen_s, "head_version": head_version,
                   "responses": len(out.token_ids)}
    if budgets:
        row["budget_mean"] = sum(budgets) / len(budgets)
    if arm.consolidator is not None:
        row |= consolidate(arm, model, policy_version, seed=round_index)
    return row, out.token_ids


def stats_row(stats: GenerationStats) -> dict:
    """A generate call's stats under the names of a round's row: the engine's and its tree
    decoder's side by side, Reflex's prefixed `reflex_` (its seconds: `time_reflex_s`)."""
    row = {k: v for k, v in vars(stats).items() if k != "tree"}
    if stats.tree is not None:
        row |= {k: v for k, v in vars(stats.tree).items() if k != "reflex"}
        if stats.tree.reflex is not None:
            row |= {"time_reflex_s" if k == "time_s" else f"reflex_{k}": v for k, v in vars(stats.tree.reflex).items()}
    return row


def consolidate(arm: Arm, model, policy_version: int, seed: int) -> dict:
    """The slow path after a step: records to the consolidator, an update if it names heads,
    committed heads to the decoder (from the next generate call on). `policy_version` names the
    policy the records came from (see `policy_version`)."""
    started = time.perf_counter()
    telemetry, records = arm.engine.decoder.pop_head_records()
    heads = arm.consolidator.observe(telemetry, records, policy_version=policy_version)
    result = arm.consolidator.update(heads, model.lm_head.weight, model.embed_tokens.weight,
                                     seed=seed) if heads else None
    if result is not None and result.committed:
        # The decoder drafts in the policy's dtype; the consolidator keeps float32 heads to train.
        p = next(model.parameters())
        arm.engine.decoder.set_heads(copy.deepcopy(arm.consolidator.heads).to(device=p.device, dtype=p.dtype))
    check = arm.consolidator.last_check  # the detector's view of this step, for tuning it
    return {"records": 0 if records is None else len(records), "heads_to_train": heads,
            "update": None if result is None else asdict(result) | {"committed": result.committed},
            "drift_check": None if check is None else {
                "z": check.z.tolist(), "acceptance_drop": check.acceptance_drop.tolist(),
                "degraded": check.degraded.tolist()},
            "detector_triggers": arm.consolidator.detector.triggers, "consolidation_s": time.perf_counter() - started}


def policy_version(round_index: int, args) -> int:
    """The version the records of a round are stamped with. The policy changes only at the drift:
    B's records stay in the replay until it is full, and A's (A's targets) age out at the drift."""
    return 0 if round_index < args.drift_at else ConsolidationConfig.max_policy_lag + 1


def run_rounds(scenario: Scenario, arms: list[Arm], args) -> dict[str, list[dict]]:
    rounds: dict[str, list[dict]] = {arm.mode: [] for arm in arms}
    for r, (indices, prompts) in enumerate(scenario.rounds):
        if r == args.drift_at:
            scenario.model.load_state_dict(scenario.policy_b)  # in place, as a rollout actor's load_policy
            for arm in arms:
                if arm.mode == CEILING:
                    arm.engine.decoder.set_heads(copy.deepcopy(scenario.heads_b))
        params = SamplingParams(temperature=args.temperature, top_p=1.0, top_k=0, max_new_tokens=args.max_new_tokens,
                                n=args.n, seed=args.seed + r)
        shift, responses = r % len(arms), {}
        for arm in arms[shift:] + arms[:shift]:  # rotated: load drifting within a round hits every arm alike
            row, responses[arm.mode] = run_arm(arm, scenario.model, prompts, params, r, policy_version(r, args))
            rounds[arm.mode].append(row | {"round": r, "policy": "A" if r < args.drift_at else "B",
                                           "prompt_indices": list(indices)})
        for mode, rows in rounds.items():
            rows[-1]["same_as_vanilla"] = same_share(responses[mode], responses[VANILLA])
        print(progress_line(r, len(scenario.rounds), rounds), flush=True)
    return rounds


def same_share(responses: list[list[int]], reference: list[list[int]]) -> float:
    """Share of the responses identical to the reference's, token for token."""
    return sum(a == b for a, b in zip(responses, reference)) / len(reference)


def progress_line(r: int, total: int, rounds: dict[str, list[dict]]) -> str:
    parts = []
    for mode, rows in rounds.items():
        row = rows[-1]
        if mode == VANILLA:
            parts.append(f"{mode} {row['tokens_per_s']:.1f} tok/s")
            continue
        text = f"{mode} {row['tokens_per_step_mean']:.2f}"
        update = row.get("update")
        if update:
            kept = "all" if list(update["kept"]) == list(update["heads"]) else ",".join(map(str, update["kept"])) or "none"
            text += f" (update {','.join(map(str, update['heads']))}, kept {kept}, {update['seconds']:.1f}s)"
        parts.append(text)
    return f"round {r + 1}/{total} policy {rows[-1]['policy']}: " + " | ".join(parts) + "  [tok/pass]"


# -- summary ------------------------------------------------------------------------------------

def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def rate(rows: list[dict]) -> float:
    """Generated tokens per second over the rows (totals, not a mean of ratios)."""
    seconds = sum(r["gen_s"] for r in rows)
    return sum(r["tokens"] for r in rows) / seconds if seconds else math.nan


def standard_error(values) -> float:
    """Of the mean, from the spread of the values (over rounds, each with its own prompts, or over seeds)."""
    values = list(values)
    if len(values) < 2:
        return math.nan
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1) / len(values))


def median(values) -> float:
    values = sorted(values)
    half = len(values) // 2
    return (values[half] if len(values) % 2 else (values[half - 1] + values[half]) / 2) if values else math.nan


def summarize(rounds: dict[str, list[dict]], drift_at: int) -> dict[str, dict]:
    """Per mode: before the drift (rounds < drift_at), after it, and its later half (heads updated by then)."""
    vanilla_after = rate(rounds[VANILLA][drift_at:])
    vanilla_rates = [r["tokens_per_s"] for r in rounds[VANILLA]]
    summary = {VANILLA: {"tokens_per_s_after": vanilla_after}}
    static_after = [r["tokens_per_step_mean"] for r in rounds["static"][drift_at:]] if "static" in rounds else None
    for mode, rows in rounds.items():
        if mode == VANILLA:
            continue
        before, after = rows[:drift_at], rows[drift_at:]
        late = after[len(after) // 2:]
        depths = len(after[0]["acceptance_by_depth"])
        gen_s = sum(r["gen_s"] for r in rows)
        updates = [r["update"] for r in rows if r.get("update")]
        summary[mode] = {
            "tokens_per_step_before": mean(r["tokens_per_step_mean"] for r in before),
            "tokens_per_step_after": mean(r["tokens_per_step_mean"] for r in after),
            "tokens_per_step_after_se": standard_error(r["tokens_per_step_mean"] for r in after),
            "tokens_per_step_late": mean(r["tokens_per_step_mean"] for r in late),
            "acceptance_by_depth_after": [mean(r["acceptance_by_depth"][d] for r in after) for d in range(depths)],
            "tokens_per_s_after": rate(after),
            # Per round against vanilla's rate in that round, the median: robust to a load spike on a shared CPU.
            "speed_ratio_after": median(r["tokens_per_s"] / v for r, v in zip(after, vanilla_rates[drift_at:])),
            "speed_ratio_after_totals": rate(after) / vanilla_after,
            "reflex_on_share_after": mean(r.get("reflex_on_share", 0.0) for r in after),
            "time_reflex_share": sum(r.get("time_reflex_s", 0.0) for r in rows) / gen_s,
            "update_attempts": len(updates),
            "updates_committed": sum(u["committed"] for u in updates),
            "update_s": sum(u["seconds"] for u in updates),
            # What the updates would add to generation if nothing overlapped them (a step also trains).
            "update_share_of_gen": sum(u["seconds"] for u in updates) / gen_s,
            "head_version_end": rows[-1]["head_version"],
            "same_as_vanilla": mean(r["same_as_vanilla"] for r in rows),
        }
        if static_after is not None:
            # Paired by round (same prompts and seeds): the prompts' own difficulty cancels out.
            gains = [r["tokens_per_step_mean"] - s for r, s in zip(after, static_after)]
            summary[mode] |= {"gain_over_static_after": mean(gains), "gain_over_static_after_se": standard_error(gains)}
    ceiling_gain = summary.get(CEILING, {}).get("gain_over_static_after")
    if ceiling_gain is not None and ceiling_gain > 0:
        for mode in rounds.keys() - {VANILLA}:
            summary[mode]["share_of_ceiling_gain"] = summary[mode]["gain_over_static_after"] / ceiling_gain
    return summary


def goals(summary: dict[str, dict]) -> dict:
    """The issue's goals after the drift, where the modes they compare ran."""
    tok = {m: s["tokens_per_step_after"] for m, s in summary.items() if m != VANILLA}
    out = {}
    if {"both", "slow", "static"} <= tok.keys():
        out["both > slow > static"] = tok["both"] > tok["slow"] > tok["static"]
    if {"both", "reflex", "static"} <= tok.keys():
        out["both >= reflex >= static"] = tok["both"] >= tok["reflex"] >= tok["static"]
    if {"both", "every_step"} <= tok.keys():
        both, every = summary["both"], summary["every_step"]
        out["both / every_step tokens per pass"] = tok["both"] / tok["every_step"]
        out["both within 5% of every_step"] = tok["both"] >= 0.95 * tok["every_step"]
        fewer = every["update_attempts"] / both["update_attempts"] if both["update_attempts"] else None
        out["every_step / both updates"] = fewer
        out["both runs >= 5x fewer updates"] = fewer is None or fewer >= 5
    if "both" in summary:
        out["both updates < 2% of generation time"] = summary["both"]["update_share_of_gen"] < 0.02
    if {CEILING, "static"} <= tok.keys():  # what the drift cost frozen heads, and so what adaptation can win back
        out["static / ceiling tokens per pass"] = tok["static"] / tok[CEILING]
    return out


def paired_gain(s: dict) -> str:
    if "gain_over_static_after" not in s:
        return "-"
    text = f"{s['gain_over_static_after']:+.3f} ± {s['gain_over_static_after_se']:.3f}"
    return text + (f" ({s['share_of_ceiling_gain']:.0%} of the ceiling's)" if "share_of_ceiling_gain" in s else "")


def across_seeds(summaries: list[dict[str, dict]], checks: list[dict]) -> dict:
    """Several seeds' runs as one: per mode the mean of its per-seed gain over static (paired by
    round) with the standard error across seeds, and per goal in how many seeds it held."""
    gains = {}
    for mode in summaries[0]:
        values = [s[mode]["gain_over_static_after"] for s in summaries if "gain_over_static_after" in s.get(mode, {})]
        if len(values) == len(summaries):
            gains[mode] = {"gain_over_static_after": mean(values), "gain_over_static_after_se": standard_error(values)}
    held = {name: sum(bool(c[name]) for c in checks) for name, value in checks[0].items() if isinstance(value, bool)}
    return {"seeds": len(summaries), "gains": gains, "goals_held": held}


def markdown_table(summary: dict[str, dict]) -> str:
    lines = ["| mode | tok/pass A | tok/pass B (± s.e.) | tok/pass B, late half | acceptance by depth (B) "
             "| speed vs vanilla (B, median) | updates run / kept | update s (share of gen) | reflex on (B) "
             "| B minus static, paired by round |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for mode, s in summary.items():
        if mode == VANILLA:
            lines.append(f"| vanilla | - | - | - | - | 1.00 ({s['tokens_per_s_after']:.1f} tok/s) | - | - | - | - |")
            continue
        acc = " ".join(f"{a:.2f}" for a in s["acceptance_by_depth_after"])
        lines.append(f"| {mode} | {s['tokens_per_step_before']:.2f} | {s['tokens_per_step_after']:.2f} "
                     f"± {s['tokens_per_step_after_se']:.2f} "
                     f"| {s['tokens_per_step_late']:.2f} | {acc} | {s['speed_ratio_after']:.2f} "
                     f"({s['tokens_per_s_after']:.1f} tok/s) | {s['update_attempts']} / {s['updates_committed']} "
                     f"| {s['update_s']:.1f} ({s['update_share_of_gen']:.1%}) | {s['reflex_on_share_after']:.0%} "
                     f"| {paired_gain(s)} |")
    return "\n".join(lines)


# -- CLI ----------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # scenario
    ap.add_argument("--policy-a", default="smollm2-135m-instruct", help="the policy the heads were trained for")
    ap.add_argument("--heads", default="shipped", help="heads for policy A: 'shipped', a file, or 'untrained'")
    ap.add_argument("--heads-b", default=None,
                    help="heads fit for policy B ('shipped' or a file; with --tiny, any value trains them here): "
                         "adds the ceiling row")
    ap.add_argument("--policy-b", default=None,
                    help="the drifted policy: alias or HF directory (default: policy A after a short SFT, made here)")
    ap.add_argument("--tiny", action="store_true", help="tiny random models instead (tests, smoke runs)")
    ap.add_argument("--tiny-drift", type=float, default=0.1, help="--tiny: noise std added to make B")
    ap.add_argument("--data-path", default=str(GSM8K_TRAIN), help="GSM8K jsonl (synthetic problems if absent)")
    ap.add_argument("--quick", action="store_true", help=f"smaller default sizes: {SIZES['quick']}")
    ap.add_argument("--rounds", type=int, default=None, help="training steps stood for (default: by --quick)")
    ap.add_argument("--drift-at", type=int, default=4, help="first round of policy B")
    ap.add_argument("--prompts", type=int, default=None, help="fresh prompts per round")
    ap.add_argument("--n", type=int, default=None, help="responses per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=1,
                    help="runs with --seed, --seed + 1, ...: gains over static averaged across them (one seed's "
                         "ordering of the modes can be noise)")
    # drafting
    ap.add_argument("--modes", nargs="+", default=list(ADAPTATION_MODES), choices=ADAPTATION_MODES)
    ap.add_argument("--budget", default="fixed", choices=["fixed", "concurrency", "cost_model"],
                    help="fixed: tokens per verify pass compare across modes at one tree size")
    ap.add_argument("--nodes", type=int, default=8, help="tree nodes per response for --budget fixed (root included)")
    ap.add_argument("--max-nodes", type=int, default=16)
    ap.add_argument("--reflex-mode", default="paper", choices=REFLEX_MODES)
    ap.add_argument("--reflex-scale", type=float, default=1.0, help="1: at most ~1%% of the head state")
    # slow path
    ap.add_argument("--calibration-steps", type=int, default=3, help="detector: rounds that set its baselines")
    # Every round, so that with `--consecutive 2` a drift can trigger 2 rounds after it starts.
    ap.add_argument("--check-every", type=int, default=1, help="detector: rounds between checks")
    # A quick round matures ~110 records of head 0, ~65 of head 1, ~25 of head 2: a head short of
    # this keeps its window until it has enough, so head 2 is checked every other round.
    ap.add_argument("--min-records", type=int, default=32, help="detector: matured records a head needs to be checked")
    ap.add_argument("--consecutive", type=int, default=2, help="detector: degraded checks in a row that trigger")
    # The design's 50 steps at checks every 20 lets the next trigger come 4 checks after one: so do 2 rounds.
    ap.add_argument("--cooldown-steps", type=int, default=2, help="detector: rounds after a trigger with no trigger")
    ap.add_argument("--max-heads-per-event", type=int, default=DriftConfig.max_heads_per_event,
                    help="detector: heads one triggered update trains (the degraded ones with the largest z)")
    ap.add_argument("--z-threshold", type=float, default=DriftConfig.z_threshold,
                    help="detector: z (of --drift-signal) above which a head may be degraded (0: at least its baseline)")
    ap.add_argument("--min-acceptance-drop", type=float, default=DriftConfig.min_acceptance_drop,
                    help="detector: acceptance drop from the baseline a degraded head also needs")
    ap.add_argument("--drift-signal", default=DriftConfig.signal, choices=DRIFT_SIGNALS,
                    help="detector: the z a degraded head needs, of TV or of the acceptance drop")
    ap.add_argument("--records-per-rollout", type=int, default=SpeculationConfig.records_per_rollout, help="record sample a generate call sends")
    ap.add_argument("--record-nodes", default="path", choices=RECORD_NODES,
                    help="records from the accepted path or every verified node (speculation.record_nodes)")
    ap.add_argument("--head-lr", type=float, default=ConsolidationConfig.lr, help="consolidation AdamW lr")
    ap.add_argument("--head-steps", type=int, default=ConsolidationConfig.steps, help="consolidation optimiser steps per update")
    ap.add_argument("--replay-capacity", type=int, default=ConsolidationConfig.replay_capacity,
                    help="consolidation: records kept for updates, newest first")
    ap.add_argument("--batch-records", type=int, default=ConsolidationConfig.batch_records,
                    help="consolidation: records per optimiser step")
    # run
    add_machine_flags(ap)
    ap.add_argument("--json", type=Path, default=None, help="every round's figures, the summary and the goals")
    ap.add_argument("--plot", type=Path, default=None, help="PNG of tokens per verify pass (default: next to --json, "
                                                            "else runs/bench_adaptation.png)")
    args = ap.parse_args(argv)
    fill_sizes(args, SIZES, args.quick)
    if not 1 <= args.drift_at < args.rounds:
        ap.error(f"--drift-at must be in [1, --rounds) so that both policies run, got {args.drift_at}")
    if args.calibration_steps > args.drift_at:
        ap.error("--calibration-steps must not exceed --drift-at: the detector calibrates on policy A")
    if args.seeds < 1:
        ap.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.plot is None:
        args.plot = args.json.with_suffix(".png") if args.json else Path("runs/bench_adaptation.png")
    return args


def write_json(path: Path | None, result: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")


def resolve_policy_b(args) -> None:
    """Without --policy-b (and --tiny), policy A after a short SFT: made once, before any seed's RNG is set."""
    if args.policy_b is not None or args.tiny:
        return
    if not Path(args.data_path).expanduser().is_file() and args.rounds * args.prompts > SKIPPED_PROBLEMS:
        raise ValueError(f"{args.rounds * args.prompts} synthetic prompts: the built policy B trained on the "
                         f"synthetic problems from {SKIPPED_PROBLEMS} on; use fewer or pass --policy-b")
    args.policy_b = str(build_drifted_policy(args.policy_a, args.device, args.threads))


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    resolve_policy_b(args)
    if args.seeds == 1:
        return run_seed(args)
    runs = []
    for k in range(args.seeds):
        one = argparse.Namespace(**vars(args))
        one.seed = args.seed + k
        one.plot = args.plot.with_name(f"{args.plot.stem}_seed{one.seed}{args.plot.suffix}")
        one.json = args.json.with_name(f"{args.json.stem}_seed{one.seed}{args.json.suffix}") if args.json else None
        print(f"\n== seed {one.seed} ({k + 1} of {args.seeds})", flush=True)
        runs.append(run_seed(one))
    pooled = across_seeds([r["summary"] for r in runs], [r["goals"] for r in runs])
    print(f"\nAcross seeds {args.seed}..{args.seed + args.seeds - 1}, B minus static (mean ± s.e. across seeds): "
          + "; ".join(f"{m} {g['gain_over_static_after']:+.3f} ± {g['gain_over_static_after_se']:.3f}"
                      for m, g in pooled["gains"].items() if m != "static"))
    print("Goals held in " + "; ".join(f"{name}: {n} of {args.seeds}" for name, n in pooled["goals_held"].items()))
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "across_seeds": pooled,
              "runs": [{"seed": args.seed + k, "summary": r["summary"], "goals": r["goals"]} for k, r in enumerate(runs)]}
    write_json(args.json, result)
    return result


def run_seed(args) -> dict:
    """One run: every mode side by side over the rounds, with `args.seed`."""
    torch.manual_seed(args.seed)
    scenario = tiny_scenario(args) if args.tiny else real_scenario(args)
    arms = build_arms(scenario, args)
    print(f"{scenario.description}, prompts from {scenario.prompt_source}; {args.rounds} rounds (drift at "
          f"{args.drift_at}) x {args.prompts} prompts x {args.n} responses, max {args.max_new_tokens} new tokens, "
          f"T={args.temperature}, budget {args.budget}"
          f"{f' {args.nodes} nodes' if args.budget == 'fixed' else ''}, "
          f"head lr {args.head_lr} x {args.head_steps} steps",
          flush=True)
    rounds = run_rounds(scenario, arms, args)

    summary = summarize(rounds, args.drift_at)
    table, checks = markdown_table(summary), goals(summary)
    print("\n" + table)
    print("\nAfter the drift: " + "; ".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}"
                                          for k, v in checks.items()))
    print("Updates run between rounds here; in training they overlap the learner (update s is not in generation time).")
    print("Responses identical to vanilla's, token for token: " + ", ".join(
        f"{mode} {s['same_as_vanilla']:.1%}" for mode, s in summary.items() if mode != VANILLA))

    from ..telemetry.plots import plot_tokens_per_pass

    series = {m: [r["tokens_per_step_mean"] for r in rows] for m, rows in rounds.items() if m != VANILLA}
    updated = {m: [r["round"] + 1 for r in rows if r.get("update") and r["update"]["committed"]]
               for m, rows in rounds.items()}
    plot_tokens_per_pass(series, args.drift_at, updated, args.plot, title=scenario.description)
    print(f"wrote {args.plot}")
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "scenario": scenario.description,
              "prompts": scenario.prompt_source, "threads": torch.get_num_threads(),
              "rounds": rounds, "summary": summary, "goals": checks, "table": table}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
