"""Draft yield: tokens per verify pass at fixed node budgets, per draft source, beside the oracle bound.

Each draft source drafts trees of a fixed node budget per response (root included; 4, 8 and 16
by default) for GRPO groups (8 responses per prompt) of held-out GSM8K test prompts, at T=1
(top-p 1) and at T=0.7 with top-p 0.9: every source alone where the others can be switched off,
and all of them combined (today's default drafter), each with blind drafts and with drafts that
read the coming draws (`speculation.read_draws`, under the Gumbel sampler: `--sampler`). Draws are
coupled: every source decodes with the same seeds, so it decodes the same responses (the share
that came out identical is printed) and only its drafts differ. The oracle bound
(benchmarks/oracle.py), a drafter blind to the draws, is computed on those responses at the same
budget, with each blind source's fraction of it; drafts that read the draws are bounded only by
every node of a path accepted: min(budget, depth + 1) tokens per pass (`bound`).

Tokens per verify pass is also the break-even cost: the plain decode steps a tree step of that
budget may cost and still pay. On a GPU a verify pass of 8-16 nodes per row costs about one
plain step until the batch fills the chip; on any machine the figure itself is the same.

The prompts are decoded `--epochs` times with a new seed each, one decoder per source, setting
and budget across them, as RL revisits its prompts every epoch: a source that drafts from
earlier rollouts has them from the second epoch on (the JSON holds each epoch's figures).

One source (`--would-be`, the heads by default) also decodes the same prompts and seeds plain,
scoring a would-be tree of each budget at every plain step (speculation/verification/would_be.py):
the `would-be` column is the tokens per verify pass those trees would have carried, beside what
the same drafts measured as real trees (their relative difference in brackets).

    python -m specroll.benchmarks.acceptance [--quick] [--policy smollm2-135m-instruct | HF_DIR | RUN_CHECKPOINT]
        [--heads shipped | FILE] [--budgets 4 8 16] [--would-be heads | none] [--json runs/bench_acceptance.json]
        [--sources heads combined] [--samplings T=1] [--drafts blind reading] [--sampler gumbel]
        [--set max_frontier=8 ...]

`--set` changes any `SpeculationConfig` field for every source (the tree selection, calibration,
lookup lengths, ...), so a drafting change is measured against the same responses as the default.
"""
from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import yaml
from tqdm.auto import tqdm

from specroll.speculation import HorizonHeads, SpeculationConfig, SpeculativeDecoder

from ..configs.typed import build_dataclass
from ..rollout import RolloutOutput, RolloutEngine, SamplingParams
from ..rollout.sampling import SAMPLERS
from .adaptation import load_heads, random_prompts, tiny_heads
from .drift import load_snapshot, peaked_tiny_model
from .engine_vs_hf import DEFAULT_GSM8K, load_prompts
from .flags import add_machine_flags, fill_sizes, write_json
from .oracle import oracle_passes, response_probabilities

# Draft sources: name -> the SpeculationConfig switch that turns the source on (None: always on).
# A source runs alone where every other source has a switch; "combined" turns every switch on.
SOURCES: dict[str, str | None] = {
    "heads": "head_drafts",
    "lookup": "context_lookup",
    "siblings": "sibling_lookup",
    "history": "history_lookup",
}
COMBINED = "combined"

# Drafts: name -> `SpeculationConfig.read_draws`.
DRAFTS = {"blind": False, "reading": True}

# Sampling settings: name -> (temperature, top_p).
SAMPLINGS = {"T=1": (1.0, 1.0), "T=0.7 top-p 0.9": (0.7, 0.9)}
SIZES = {"full": dict(prompts=8, max_new_tokens=192, budgets=[4, 8, 16]),
         "quick": dict(prompts=1, max_new_tokens=48, budgets=[8, 16])}  # the goals are at 8 and 16 nodes


def source_settings(sources: dict[str, str | None]) -> dict[str, dict[str, bool]]:
    """What to measure: source -> SpeculationConfig overrides. Each source alone where every other
    source can be switched off, then every source on together (when there are several)."""
    switches = {name: switch for name, switch in sources.items() if switch is not None}
    settings = {}
    for name in sources:
        others = [s for n, s in sources.items() if n != name]
        if None not in others:
            settings[name] = {s: n == name for n, s in switches.items()}
    if len(sources) > 1:
        settings[COMBINED] = dict.fromkeys(switches.values(), True)
    return settings


@dataclass
class Tally:
    """Tokens emitted and verify passes over live rows, per epoch."""

    tokens: list[float] = field(default_factory=list)
    passes: list[int] = field(default_factory=list)

    def add(self, tokens: float, passes: int) -> None:
        self.tokens.append(tokens)
        self.passes.append(passes)

    @property
    def per_pass(self) -> float:
        return sum(self.tokens) / max(sum(self.passes), 1)

    @property
    def per_pass_by_epoch(self) -> list[float]:
        return [t / max(p, 1) for t, p in zip(self.tokens, self.passes)]


def tree_tally(out: RolloutOutput) -> tuple[int, int]:
    """(tokens the responses kept, verify passes) of one generate call's live rows, the prompt's
    pass excluded. A pass that accepted past a response's stop token or length cap counts what the
    response kept, as the oracle's walk along the response does."""
    hist = out.stats.tree.tokens_per_step_hist
    return sum(k * n for k, n in hist.items()), sum(hist.values())


def decode_epochs(engine: RolloutEngine, prompts, sampling: tuple[float, float], args, bar: tqdm):
    """[(sampling params, output)] of each epoch's generate call, a new seed each; each epoch's
    responses are the next one's history."""
    temperature, top_p = sampling
    runs = []
    for epoch in range(args.epochs):
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=0, max_new_tokens=args.max_new_tokens,
                                n=args.group, seed=args.seed + epoch, sampler=args.sampler)
        out = engine.generate(prompts, params)
        engine.decoder.learn_from_responses(prompts, out.token_ids, args.group)
        bar.update()
        runs.append((params, out))
    return runs


def plain_with_would_be(cfg: SpeculationConfig) -> SpeculationConfig:
    """`cfg`'s drafts as would-be trees of its fixed_nodes, one scored from every plain step where
    a row holds none; a capacity of one node per row never sizes a tree, so every step is plain."""
    return replace(cfg, budget="concurrency", capacity=1, would_be_every=1)


def would_be_row(model, tokenizer, heads: HorizonHeads, prompts, cfg: SpeculationConfig, sampling: tuple[float, float],
                 args, bar: tqdm, tree_yield: float, tree_responses: list) -> dict:
    """What `cfg`'s drafts would have carried as would-be trees while decoding plain, beside what
    they carried as real trees (`tree_yield` tokens per pass, `tree_responses` by epoch)."""
    engine = RolloutEngine(model, tokenizer, SpeculativeDecoder(model, plain_with_would_be(cfg), heads=heads))
    tally, same = Tally(), 0
    for epoch, (_, out) in enumerate(decode_epochs(engine, prompts, sampling, args, bar)):
        tally.add(out.stats.tree.would_be_tokens, out.stats.tree.would_be_passes)
        same += sum(a == b for a, b in zip(out.token_ids, tree_responses[epoch]))
    return {"would_be_tokens_per_pass": tally.per_pass, "would_be_tokens_per_pass_by_epoch": tally.per_pass_by_epoch,
            "would_be_passes": sum(tally.passes), "would_be_vs_trees": tally.per_pass / tree_yield - 1,
            "would_be_same_responses": same / (len(prompts) * args.group * args.epochs)}


def measure_setting(model, tokenizer, heads: HorizonHeads, prompts, base: SpeculationConfig, sampling: tuple[float, float],
                    budget: int, args, bar: tqdm) -> list[dict]:
    """Every source at one sampling setting and budget, over the epochs: one row per source and
    drafts (`--drafts`; the `--would-be` source's first with its would-be yield)."""
    settings = {name: overrides for name, overrides in source_settings(SOURCES).items() if name in args.sources}
    oracle, reference = Tally(), {}  # reference: epoch -> the first source's responses
    rows = []
    for (name, overrides), drafts in itertools.product(settings.items(), args.drafts):
        cfg = replace(base, fixed_nodes=budget, max_nodes=budget, read_draws=DRAFTS[drafts], **overrides)
        engine = RolloutEngine(model, tokenizer, SpeculativeDecoder(model, cfg, heads=heads))
        tally, same, responses, depth, lookup_share = Tally(), 0, [], [], []
        for epoch, (params, out) in enumerate(decode_epochs(engine, prompts, sampling, args, bar)):
            tally.add(*tree_tally(out))
            depth.append(out.stats.tree.acceptance_by_depth)
            lookup_share.append(out.stats.tree.lookup_token_share)
            if epoch not in reference:
                reference[epoch] = out.token_ids
                probabilities = response_probabilities(model, prompts, out.token_ids, params)
                oracle.add(*oracle_passes(probabilities, [budget], engine.decoder.depth))
            same += sum(a == b for a, b in zip(out.token_ids, reference[epoch]))
            responses.append(out.token_ids)
        row = {"source": name, "drafts": drafts, "overrides": overrides, "tokens_per_pass": tally.per_pass,
               "tokens_per_pass_by_epoch": tally.per_pass_by_epoch, "verify_passes": sum(tally.passes),
               "same_responses": same / sum(map(len, responses)),
               "acceptance_by_depth": [sum(d) / len(d) for d in zip(*depth)],
               "lookup_token_share": sum(lookup_share) / len(lookup_share),
               "bound_tokens_per_pass": min(budget, engine.decoder.depth + 1)}
        if name == args.would_be and drafts == args.drafts[0]:
            row |= would_be_row(model, tokenizer, heads, prompts, cfg, sampling, args, bar, tally.per_pass, responses)
        rows.append(row)
    blind = {r["source"]: r["tokens_per_pass"] for r in rows if r["drafts"] == "blind"}
    for row in rows:
        if row["drafts"] == "reading" and row["source"] in blind:
            row["reading_vs_blind"] = row["tokens_per_pass"] / blind[row["source"]] - 1
        row |= {"oracle_tokens_per_pass": oracle.per_pass, "oracle_tokens_per_pass_by_epoch": oracle.per_pass_by_epoch,
                "fraction_of_oracle": row["tokens_per_pass"] / oracle.per_pass if sum(oracle.passes) else float("nan"),
                # A tree step of this budget pays while it costs fewer plain steps than it emits tokens.
                "break_even_plain_steps": row["tokens_per_pass"]}
    return rows


def would_be_note(row: dict) -> str:
    """The progress line's would-be part (empty for the sources measured as trees alone)."""
    if "would_be_tokens_per_pass" not in row:
        return ""
    return (f"; would-be {row['would_be_tokens_per_pass']:.2f} ({row['would_be_vs_trees']:+.1%}, "
            f"{row['would_be_passes']} trees, same responses {row['would_be_same_responses']:.0%})")


def yield_cell(row: dict) -> str:
    """A row's tokens per pass: blind drafts with their fraction of the oracle, reading ones with
    their change from the same source's blind drafts (where measured)."""
    if row["drafts"] == "blind":
        return f"{row['tokens_per_pass']:.2f} ({row['fraction_of_oracle']:.0%})"
    change = f" ({row['reading_vs_blind']:+.1%})" if "reading_vs_blind" in row else ""
    return f"{row['tokens_per_pass']:.2f}{change}"


def markdown_table(rows: list[dict]) -> str:
    """One line per sampling setting and budget: the oracle (blind drafts' bound) and the bound of
    drafts that read the draws, then each source's tokens per pass (= break-even plain steps per
    tree step) for each kind of drafts, then the would-be yield of the `--would-be` source with its
    difference from that source's trees."""
    columns = list(dict.fromkeys((r["source"], r["drafts"]) for r in rows))
    would_be = next((r for r in rows if "would_be_tokens_per_pass" in r), None)
    would_be = would_be and (would_be["source"], would_be["drafts"])
    names = [f"{s} {d}" for s, d in columns] + ([f"would-be ({would_be[0]} {would_be[1]})"] if would_be else [])
    lines = ["| sampling | nodes | oracle | bound | " + " | ".join(names) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(names)]
    for key in dict.fromkeys((r["sampling"], r["budget"]) for r in rows):
        group = {(r["source"], r["drafts"]): r for r in rows if (r["sampling"], r["budget"]) == key}
        cells = [yield_cell(group[c]) if c in group else "-" for c in columns]
        if would_be:
            row = group.get(would_be, {})
            cells.append(f"{row['would_be_tokens_per_pass']:.2f} ({row['would_be_vs_trees']:+.1%})" if row else "-")
        first = next(iter(group.values()))
        lines.append(f"| {key[0]} | {key[1]} | {first['oracle_tokens_per_pass']:.2f} | {first['bound_tokens_per_pass']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def config_overrides(assignments: list[str]) -> dict:
    """`--set KEY=VALUE ...` as {field: value}, each value read as YAML (8, 0.5, true, [1, 2])."""
    overrides = {}
    for assignment in assignments:
        key, sep, value = assignment.partition("=")
        if not sep or not key:
            raise ValueError(f"takes KEY=VALUE, got {assignment!r}")
        overrides[key.strip()] = yaml.safe_load(value)
    return overrides


def base_config(head_type: str, num_heads: int, overrides: dict) -> SpeculationConfig:
    """The drafter every source starts from: fixed budgets for such heads, with `--set`'s changes
    (checked as the training config's are: an unknown field or a bad value names the field)."""
    base = SpeculationConfig(head_type=head_type, num_heads=num_heads, budget="fixed", min_nodes=1)
    return build_dataclass(SpeculationConfig, asdict(base) | overrides) if overrides else base


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="smollm2-135m-instruct",
                    help="model alias, Hugging Face directory (an SFT output) or a run's checkpoint directory")
    ap.add_argument("--heads", default="shipped",
                    help="'shipped' (SpecRoll's heads for the policy, or for a run checkpoint's model), a heads file, or 'untrained'")
    ap.add_argument("--tiny", action="store_true", help="a tiny random policy with heads trained here (tests, smoke runs)")
    ap.add_argument("--data", type=Path, default=DEFAULT_GSM8K,
                    help="held-out prompts: GSM8K test jsonl (without it, built-in synthetic problems)")
    ap.add_argument("--quick", action="store_true", help=f"smaller default sizes: {SIZES['quick']} (full: {SIZES['full']})")
    ap.add_argument("--prompts", type=int, default=None, help="held-out prompts, each a GRPO group")
    ap.add_argument("--group", type=int, default=8, help="responses per prompt (GRPO's n)")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--budgets", type=int, nargs="+", default=None, help="nodes per response, root included")
    ap.add_argument("--epochs", type=int, default=2, help="passes over the same prompts, a new seed each")
    ap.add_argument("--would-be", default="heads", choices=[*source_settings(SOURCES), "none"],
                    help="the source whose drafts are also scored as would-be trees while decoding plain (none: no such run)")
    ap.add_argument("--sources", nargs="+", default=list(source_settings(SOURCES)), choices=list(source_settings(SOURCES)),
                    help="the sources to measure (default: each alone and combined)")
    ap.add_argument("--samplings", nargs="+", default=list(SAMPLINGS), choices=list(SAMPLINGS),
                    help="the sampling settings to measure (default: both)")
    ap.add_argument("--drafts", nargs="+", default=list(DRAFTS), choices=list(DRAFTS),
                    help="blind drafts, drafts that read the coming draws, or both (default); reading needs --sampler gumbel")
    ap.add_argument("--sampler", default="gumbel", choices=SAMPLERS,
                    help="how a draw becomes a token (rollout.sampler): drafts read the draws under gumbel alone")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="SpeculationConfig fields changed for every source, e.g. max_frontier=8 max_children=16")
    ap.add_argument("--seed", type=int, default=0)
    add_machine_flags(ap)
    ap.add_argument("--json", type=Path, default=None, help="every row, the table and the arguments")
    ap.add_argument("--plot", type=Path, default=None,
                    help="the figure (default: the --json path with .png, else runs/bench_acceptance.png)")
    args = ap.parse_args(argv)
    fill_sizes(args, SIZES, args.quick)
    for name in ("prompts", "group", "max_new_tokens", "epochs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if "reading" in args.drafts and args.sampler != "gumbel":
        ap.error("--drafts reading reads the Gumbel sampler's noise: it needs --sampler gumbel")
    if min(args.budgets) < 2:
        ap.error("--budgets must be >= 2 (a 1-node budget is plain decoding)")
    try:
        args.overrides = config_overrides(args.set)
        base_config("path", 4, args.overrides)
    except ValueError as exc:
        ap.error(f"--set: {exc}")
    if args.plot is None:
        args.plot = args.json.with_suffix(".png") if args.json else Path("runs/bench_acceptance.png")
    return args


def scenario(args):
    """(model, tokenizer, heads, prompts, where the prompts came from)."""
    if args.tiny:
        model = peaked_tiny_model(3)
        g = torch.Generator().manual_seed(args.seed)
        heads = tiny_heads(model, random_prompts(g, 8))
        return model, None, heads, random_prompts(g, args.prompts), "random tokens"
    model, tokenizer = load_snapshot(args.policy, args.dtype, args.device)
    model.requires_grad_(False)
    heads = load_heads(args.heads, model.config.name, model)  # a run checkpoint's: its base model's shipped heads
    prompts, source = load_prompts(tokenizer, args.prompts, args.data.expanduser())
    if source == "synthetic":
        print(f"note: no GSM8K test split at {args.data}: built-in synthetic problems instead (pass --data)")
    return model, tokenizer, heads, prompts, source


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tokenizer, heads, prompts, source = scenario(args)
    base = base_config(heads.head_type, heads.num_heads, args.overrides)
    policy = "tiny random policy" if args.tiny else args.policy
    print(f"{policy}, heads {'trained here' if args.tiny else args.heads}; {len(prompts)} prompts from {source} "
          f"x {args.group} responses x {args.max_new_tokens} new tokens, {args.epochs} epochs; "
          f"budgets {args.budgets}; sources {args.sources}" + (f"; set {args.overrides}" if args.overrides else ""),
          flush=True)
    rows, started = [], time.perf_counter()
    runs = len(args.sources) * len(args.drafts) + (args.would_be in args.sources)  # every source's trees, the would-be one's plain
    calls = len(args.samplings) * len(args.budgets) * runs * args.epochs
    bar = tqdm(total=calls, desc="generate calls", unit="call")
    for sampling in args.samplings:
        values = SAMPLINGS[sampling]
        for budget in args.budgets:
            for row in measure_setting(model, tokenizer, heads, prompts, base, values, budget, args, bar):
                rows.append({"sampling": sampling, "temperature": values[0], "top_p": values[1], "budget": budget} | row)
                bar.write(f"{sampling}, {budget} nodes, {row['source']} {row['drafts']}: {row['tokens_per_pass']:.2f} "
                          f"tokens per pass, oracle {row['oracle_tokens_per_pass']:.2f} ({row['fraction_of_oracle']:.0%}), "
                          f"bound {row['bound_tokens_per_pass']}, "
                          f"same responses {row['same_responses']:.0%}" + would_be_note(row))
    bar.close()
    elapsed = time.perf_counter() - started
    table = markdown_table(rows)
    print("\ntokens per verify pass = the break-even cost: plain steps a tree step of that budget may cost and "
          "still pay (blind drafts: fraction of the oracle bound in brackets; reading drafts: change from blind; "
          "bound: every node of a path accepted); would-be: what the same drafts would have carried while decoding "
          "plain (difference from their trees in brackets)\n" + table + f"\n({elapsed:.0f} s)")

    from ..telemetry.plots import plot_yield_by_budget

    curves = {s: {f"{name} {drafts}": [(r["budget"], r["tokens_per_pass"]) for r in rows
                                      if (r["sampling"], r["source"], r["drafts"]) == (s, name, drafts)]
                  for name, drafts in dict.fromkeys((r["source"], r["drafts"]) for r in rows)} for s in args.samplings}
    oracle = {s: [(r["budget"], r["oracle_tokens_per_pass"]) for r in rows
                  if (r["sampling"], r["source"], r["drafts"]) == (s, rows[0]["source"], rows[0]["drafts"])]
              for s in args.samplings}
    plot_yield_by_budget(curves, oracle, args.plot,
                         title=f"{policy}: groups of {args.group}, {args.max_new_tokens} new tokens, {source}")
    print(f"wrote {args.plot}")
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "prompt_source": source, "elapsed_s": elapsed,
              "config": asdict(base), "rows": rows, "table": table}
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
