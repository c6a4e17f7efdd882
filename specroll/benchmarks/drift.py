"""How frozen draft heads decay as the policy moves (docs/algorithm.md, section 5).

Given a sequence of policy snapshots (the first is the policy the heads were trained for),
measure on each, with the same held-out prompts and seeds, the tokens per verify pass and the
acceptance by depth of (a) the heads, frozen, and (b) the same heads retrained on that
snapshot's own samples (the ceiling a perfect slow path would reach). The retrained figure at
the first snapshot separates what the extra training alone adds from what the drift takes.
How far each snapshot moved is the mean per-token KL(snapshot || first) on its own responses.

Snapshots: a run's checkpoints (`run_dir/checkpoints/step_*`), SFT outputs, model aliases:

    # a GRPO run's drift (a run started with checkpoint_every=5 keep_last=10 keeps four snapshots)
    python -m specroll.benchmarks.drift --policies ~/.cache/specroll/sft/gsm8k200 runs/drift/checkpoints/step_*
        --heads runs/drift_heads/1.heads.safetensors --retrain-positions 0 --json runs/bench_drift.json
    # controlled drift: the instruct policy's heads drafting for the SFT'd policy; --save-heads
    # keeps each snapshot's retrained heads, which the reverse drift starts from
    python -m specroll.benchmarks.drift --policies smollm2-135m-instruct ~/.cache/specroll/sft/gsm8k200
        --save-heads runs/drift_heads
    python -m specroll.benchmarks.drift --policies ~/.cache/specroll/sft/gsm8k200 smollm2-135m-instruct
        --heads runs/drift_heads/1.heads.safetensors

Drafters for one policy sample the same responses for a seed (speculation/verification/verify.py), up to float
rounding; each figure still carries the prompts' noise (its standard error over batches of
prompts is printed).
"""
from __future__ import annotations

import argparse
import copy
import math
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specroll.speculation import HorizonHeads, SpeculationConfig, SpeculativeDecoder
from specroll.speculation.drafting.heads import model_fingerprint
from specroll.speculation.head_training.samples import SampleConfig, collect_samples, dataset_prompts
from specroll.speculation.head_training.training import HeadTrainConfig, train_heads

from ..models import build_tiny_model, load_causal_lm
from ..rollout import RolloutEngine, SamplingParams
from .adaptation import TINY_VOCAB, load_heads, random_prompts, standard_error, tiny_heads
from .engine_vs_hf import DEFAULT_GSM8K, load_prompts
from .flags import add_machine_flags, fill_sizes, write_json
from .grpo_steps import GSM8K_TRAIN

TINY_LOGIT_SCALE = 4.0  # sharpens the tiny models' distributions so that heads have something to learn
SIZES = {"full": dict(prompts=16, max_new_tokens=192, retrain_positions=20_000),
         "quick": dict(prompts=8, max_new_tokens=96, retrain_positions=4_000)}


@dataclass
class Snapshot:
    label: str  # as given on the command line
    model: torch.nn.Module


# -- snapshots ----------------------------------------------------------------------------------

def load_snapshot(spec: str, dtype: str, device: str):
    """A checkpoint directory of a run (its policy weights on the run's model), or anything
    `load_causal_lm` takes. Returns (model, tokenizer)."""
    from ..eval.policy import checkpoint_model, read_checkpoint_policy
    from ..learner.checkpoint import COMPLETE_MARKER

    path = Path(spec).expanduser()
    if not (path / COMPLETE_MARKER).is_file():
        return load_causal_lm(str(path) if path.exists() else spec, dtype=dtype, device=device)
    policy = read_checkpoint_policy(path)
    return checkpoint_model(policy, replace(policy.model_section, dtype=dtype, device=device))


def peaked_tiny_model(seed: int):
    """A random 2-layer model with peaked next-token distributions."""
    model = build_tiny_model(vocab_size=TINY_VOCAB, init_std=0.15, seed=seed).requires_grad_(False)
    model.norm.weight.mul_(TINY_LOGIT_SCALE)
    return model


def tiny_snapshots(count: int) -> list[Snapshot]:
    """A peaked tiny model, then weight interpolations from it to another such model (the last
    snapshot): a drift as large as a policy change gets."""
    start, end = peaked_tiny_model(3), peaked_tiny_model(4)
    snapshots = []
    for i in range(count):
        alpha = i / (count - 1)
        model = copy.deepcopy(start)
        model.load_state_dict({k: torch.lerp(v, end.state_dict()[k], alpha) for k, v in start.state_dict().items()})
        snapshots.append(Snapshot(f"tiny {alpha:.0%} of the way to another", model))
    return snapshots


# -- measurements -------------------------------------------------------------------------------

def draft_stats(model, heads: HorizonHeads, prompts: list[list[int]], args) -> dict:
    """Tokens per verify pass and acceptance by depth drafting `args.nodes`-node trees with
    `heads`, over batches of `args.batch` prompts (the standard error is over batches); the
    sampled sequences come back for the KL."""
    spec = SpeculationConfig(head_type=heads.head_type, num_heads=heads.num_heads, heads_path=None, budget="fixed",
                      fixed_nodes=args.nodes, max_nodes=max(16, args.nodes))
    engine = RolloutEngine(model, decoder=SpeculativeDecoder(model, spec))
    engine.decoder.set_heads(heads)
    emitted = passes = 0
    per_batch, acceptance, sequences = [], [], []
    for b in range(0, len(prompts), args.batch):
        batch = prompts[b : b + args.batch]
        out = engine.generate(batch, SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens,
                                                    seed=args.seed + b))
        hist = out.stats.tree.tokens_per_step_hist
        emitted += sum(k * v for k, v in hist.items())
        passes += sum(hist.values())
        per_batch.append(out.stats.tree.tokens_per_step_mean)
        acceptance.append(out.stats.tree.acceptance_by_depth)
        sequences += [p + r for p, r in zip(batch, out.token_ids)]
    return {"tokens_per_pass": emitted / max(passes, 1), "tokens_per_pass_se": standard_error(per_batch),
            "acceptance_by_depth": [sum(a) / len(a) for a in zip(*acceptance)], "sequences": sequences}


@torch.no_grad()
def mean_kl(model, reference, sequences: list[list[int]], prompt_lens: list[int]) -> float:
    """Mean over response tokens of KL(model || reference), the next-token distributions on `sequences`."""
    total, count = 0.0, 0
    for ids, start in zip(sequences, prompt_lens):
        if len(ids) <= start:
            continue
        x = torch.tensor([ids], device=next(model.parameters()).device)
        logp = torch.log_softmax(model(x).logits[0, start - 1 : -1].float(), dim=-1)
        logq = torch.log_softmax(reference(x).logits[0, start - 1 : -1].float(), dim=-1)
        total += (logp.exp() * (logp - logq)).sum().item()
        count += len(ids) - start
    return total / count if count else math.nan


def retrained(model, heads: HorizonHeads, train_prompts: list[list[int]], args) -> HorizonHeads:
    """`heads` trained further on `model`'s own samples (`--retrain-positions` response tokens)."""
    heads = copy.deepcopy(heads)
    # train_heads' sampling settings, so `train_heads --dataset gsm8k` and FastGRPO pretraining share the cache.
    cfg = SampleConfig(positions=args.retrain_positions, max_new_tokens=args.retrain_max_new_tokens, seed=args.seed)
    samples = collect_samples(model, train_prompts, cfg, args.samples_cache, progress=True)
    train_heads(model, heads, samples.sequences, HeadTrainConfig(epochs=args.retrain_epochs, lr=args.retrain_lr),
                progress=True, log=lambda _: None)
    return heads


# -- the curve ----------------------------------------------------------------------------------

def measure(snapshots: list[Snapshot], heads: HorizonHeads, eval_prompts, train_prompts, args) -> list[dict]:
    first = snapshots[0].model
    prompt_lens = [len(p) for p in eval_prompts]
    rows = []
    for i, snap in enumerate(snapshots):
        started = time.perf_counter()
        if model_fingerprint(snap.model.config) != model_fingerprint(first.config):
            raise ValueError(f"{snap.label} is not the architecture of {snapshots[0].label}: heads cannot carry over")
        frozen = draft_stats(snap.model, heads, eval_prompts, args)
        row = {"snapshot": snap.label, "kl_from_first": mean_kl(snap.model, first, frozen.pop("sequences"),
                                                                prompt_lens),
               "frozen": frozen}
        if args.retrain_positions:
            own = retrained(snap.model, heads, train_prompts, args)
            if args.save_heads:
                args.save_heads.mkdir(parents=True, exist_ok=True)
                own.save(args.save_heads / f"{i}.heads.safetensors")
            row["retrained"] = draft_stats(snap.model, own, eval_prompts, args)
            row["retrained"].pop("sequences")
        row["seconds"] = time.perf_counter() - started
        rows.append(row)
        print(progress_line(i, len(snapshots), row), flush=True)
    return rows


def progress_line(i: int, total: int, row: dict) -> str:
    text = (f"snapshot {i + 1}/{total} {row['snapshot']}: KL from first {row['kl_from_first']:.4f}, "
            f"frozen {row['frozen']['tokens_per_pass']:.2f} tok/pass")
    if "retrained" in row:
        text += f", retrained {row['retrained']['tokens_per_pass']:.2f}"
    return text + f" ({row['seconds']:.0f}s)"


def markdown_table(rows: list[dict]) -> str:
    arms = ("frozen", "retrained") if "retrained" in rows[0] else ("frozen",)
    header = ["snapshot", "KL from first"]
    for arm in arms:
        header += [f"{arm} tok/pass (± s.e.)", f"{arm} acceptance by depth"]
    if len(arms) == 2:
        header.append("frozen / retrained")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [r["snapshot"], f"{r['kl_from_first']:.4f}"]
        for arm in arms:
            cells += [f"{r[arm]['tokens_per_pass']:.2f} ± {r[arm]['tokens_per_pass_se']:.2f}",
                      " ".join(f"{a:.2f}" for a in r[arm]["acceptance_by_depth"])]
        if len(arms) == 2:
            cells.append(f"{r['frozen']['tokens_per_pass'] / r['retrained']['tokens_per_pass']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- CLI ----------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", nargs="+", default=None,
                    help="snapshots in order, the first the heads' own policy: checkpoint dirs, HF dirs or aliases")
    ap.add_argument("--heads", default="shipped", help="heads for the first snapshot: 'shipped' or a heads file")
    ap.add_argument("--tiny", type=int, default=0, metavar="N",
                    help="N tiny random snapshots, from one random model to another, instead (tests, smoke runs)")
    ap.add_argument("--eval-data", type=Path, default=DEFAULT_GSM8K, help="held-out prompts: GSM8K test jsonl")
    ap.add_argument("--train-data", type=Path, default=GSM8K_TRAIN, help="retraining prompts: GSM8K train jsonl")
    ap.add_argument("--quick", action="store_true", help=f"smaller default sizes: {SIZES['quick']}")
    ap.add_argument("--prompts", type=int, default=None, help="held-out prompts, one response each")
    ap.add_argument("--batch", type=int, default=4, help="prompts per generate call (the standard error is over these)")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--nodes", type=int, default=8, help="tree nodes per response (root included), fixed")
    ap.add_argument("--retrain-positions", type=int, default=None,
                    help="response tokens of each snapshot to retrain the heads on; 0 skips the ceiling")
    ap.add_argument("--retrain-max-new-tokens", type=int, default=SampleConfig.max_new_tokens,
                    help="response cap of the retraining samples (train_heads' default)")
    ap.add_argument("--retrain-epochs", type=int, default=2)
    ap.add_argument("--retrain-lr", type=float, default=3e-4)
    ap.add_argument("--samples-cache", default=None, help="where retraining samples are cached (default: ~/.cache)")
    ap.add_argument("--save-heads", type=Path, default=None,
                    help="keep snapshot i's retrained heads as i.heads.safetensors")
    ap.add_argument("--seed", type=int, default=0)
    add_machine_flags(ap)
    ap.add_argument("--json", type=Path, default=None, help="the curve's figures")
    ap.add_argument("--plot", type=Path, default=None,
                    help="PNG of the curve (default: next to --json, else runs/bench_drift.png)")
    args = ap.parse_args(argv)
    fill_sizes(args, SIZES, args.quick)
    if bool(args.tiny) == bool(args.policies):
        ap.error("give either --policies (two or more) or --tiny N")
    if args.policies is not None and len(args.policies) < 2:
        ap.error("--policies needs the heads' own policy and at least one later snapshot")
    if args.tiny == 1:
        ap.error("--tiny needs at least 2 snapshots")
    for name in ("prompts", "batch", "max_new_tokens", "nodes", "retrain_epochs", "retrain_max_new_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.plot is None:
        args.plot = args.json.with_suffix(".png") if args.json else Path("runs/bench_drift.png")
    return args


def scenario(args):
    """(snapshots, frozen heads, held-out prompts, retraining prompts)."""
    if args.tiny:
        snapshots = tiny_snapshots(args.tiny)
        g = torch.Generator().manual_seed(args.seed)
        heads = tiny_heads(snapshots[0].model, random_prompts(g, 8), positions=8000, epochs=6)
        return snapshots, heads, random_prompts(g, args.prompts), random_prompts(g, 64)
    snapshots, tokenizer = [], None
    for spec in args.policies:
        model, tokenizer = load_snapshot(spec, args.dtype, args.device)
        snapshots.append(Snapshot(spec, model.requires_grad_(False)))
    heads = load_heads(args.heads, args.policies[0], snapshots[0].model)
    eval_prompts, _ = load_prompts(tokenizer, args.prompts, args.eval_data.expanduser())
    train_prompts = dataset_prompts(tokenizer, ["gsm8k"], str(args.train_data.expanduser()))
    return snapshots, heads, eval_prompts, train_prompts


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    snapshots, heads, eval_prompts, train_prompts = scenario(args)
    retraining = f"retraining on {args.retrain_positions} positions" if args.retrain_positions else "no retraining"
    print(f"{len(snapshots)} snapshots, heads {'tiny' if args.tiny else args.heads}; {len(eval_prompts)} held-out "
          f"prompts x {args.max_new_tokens} new tokens, T=1, {args.nodes} nodes; {retraining}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        if args.samples_cache is None and args.tiny:
            args.samples_cache = scratch
        rows = measure(snapshots, heads, eval_prompts, train_prompts, args)
    table = markdown_table(rows)
    print("\n" + table)

    from ..telemetry.plots import plot_drift

    arms = "frozen vs retrained" if args.retrain_positions else "frozen"
    plot_drift(rows, args.plot, title=f"heads of {Path(rows[0]['snapshot']).name}, {arms}")
    print(f"wrote {args.plot}")
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "table": table}
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
