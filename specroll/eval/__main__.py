"""Evaluate a policy on held-out problems: greedy accuracy, and pass@k over sampled responses.

    python -m specroll.eval runs/quickstart                        # a run's newest checkpoint, its own data
    python -m specroll.eval runs/quickstart/checkpoints/step_00000020 --limit 16 --json eval.json
    python -m specroll.eval /path/to/hf_model data=gsm8k data.path=/path/to/gsm8k --n 8 --k 1,4,8
    python -m specroll.eval smollm2-135m-instruct --decoding plain eval.split=test

SOURCE is a run_dir (its newest intact checkpoint), a checkpoint folder, a Hugging Face model
directory, a .gguf file, a model alias or a hub name. A checkpoint is evaluated under the config
it was saved with (model, data, rollout, eval), a model under `conf/`'s defaults; `key=value`
overrides change either (`data=gsm8k` picks a preset of conf/data/). The held-out problems are
`eval.path`, else `data.path` at `eval.split` (synthetic: the problems after the training set's).
Responses come from our engine, speculative by default (its responses are plain sampling's).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omegaconf import OmegaConf
from tqdm.auto import tqdm

from specroll.command_line import compose_train_config, conf_dir, errors_as_messages
from specroll.configs import TrainConfig, load_train_config
from specroll.configs.train import check_held_out
from specroll.decoders import build_decoder
from specroll.rollout import RolloutEngine

from .evaluation import EvalReport, eval_plan, evaluate
from .held_out import load_held_out
from .policy import CheckpointPolicy, checkpoint_model, find_checkpoint, read_checkpoint_policy

COMMAND = "python -m specroll.eval"
DECODING_MODES = {"speculative": "speculation", "plain": "vanilla"}  # --decoding -> rollout.mode


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="run_dir, checkpoint folder, Hugging Face directory, .gguf file, alias or hub name")
    p.add_argument("overrides", nargs="*", help="config overrides key=value (data=gsm8k, data.path=..., eval.split=...)")
    p.add_argument("--decoding", choices=tuple(DECODING_MODES), default="speculative",
                   help="speculative (default; the same responses as plain) or plain decoding")
    p.add_argument("--limit", type=int, help="evaluate the first LIMIT held-out problems (eval.limit)")
    p.add_argument("--n", type=int, help="responses sampled per problem for pass@k (eval.samples); 0: greedy only")
    p.add_argument("--k", help="comma-separated k of pass@k, each <= --n (eval.k), e.g. 1,4,8")
    p.add_argument("--json", metavar="PATH", help="write the results (metrics and each problem's) as JSON; - for stdout")
    args = p.parse_intermixed_args(argv)  # overrides may come before and after the flags
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        p.error(f"overrides are key=value, got {bad}")
    return args


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """The flags as config overrides (they win over the same keys given as overrides)."""
    out = [f"rollout.mode={DECODING_MODES[args.decoding]}"]
    if args.limit is not None:
        out.append(f"eval.limit={args.limit}")
    if args.n is not None:
        out.append(f"eval.samples={args.n}")
    if args.k is not None:
        out.append(f"eval.k=[{args.k}]")
    return out


def apply_overrides(values: dict, overrides: list[str]) -> dict:
    """`values` (a saved run config) with `key=value` overrides; `group=name` takes conf/<group>/<name>.yaml whole."""
    merged = OmegaConf.create(values)
    for override in overrides:
        key, value = override.split("=", 1)
        preset = Path(conf_dir()) / key / f"{value}.yaml"
        if "." not in key and preset.is_file():
            merged[key] = OmegaConf.load(preset)
        else:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([override]))
    return OmegaConf.to_container(merged, resolve=True)


def eval_config(source: str, policy: CheckpointPolicy | None, overrides: list[str]) -> TrainConfig:
    """A checkpoint's saved run config, else conf/'s defaults for model `source`, with `overrides`."""
    if policy is not None and policy.run_config:
        # resume: the saved run's value may name a checkpoint since moved; nothing is resumed here.
        return load_train_config(apply_overrides({**policy.run_config, "resume": "auto"}, overrides))
    name = policy.model_section.name if policy is not None else source
    return compose_train_config([f"model.name={name}", *overrides])


def run_eval(source: str, overrides: list[str], show_progress: bool = True) -> tuple[TrainConfig, EvalReport]:
    """Evaluate `source` as `overrides` say; the config used and the report."""
    checkpoint = find_checkpoint(source)
    policy = read_checkpoint_policy(checkpoint) if checkpoint is not None else None
    cfg = eval_config(source, policy, overrides)
    check_held_out(cfg)
    problems = load_held_out(cfg.data, cfg.eval)
    model, tokenizer = checkpoint_model(policy, cfg.model, cfg.seed) if policy is not None else cfg.model.load(cfg.seed)
    if tokenizer is None:
        raise ValueError("model.tokenizer must be set for a tiny model: prompts are formatted and responses scored as text")
    # The checkpoint's heads replace the configured ones, where the decoder drafts with heads.
    decoder = build_decoder(model, cfg.rollout, heads=None if policy is None else policy.heads)
    engine = RolloutEngine(model, tokenizer, decoder, sync_every=cfg.rollout.sync_every)
    with tqdm(total=len(problems), desc="held-out problems", unit="problem", disable=not show_progress or None) as bar:
        report = evaluate(engine, tokenizer, problems, cfg.data.instruction, cfg.data.reward,
                          eval_plan(cfg.rollout, cfg.eval), cfg.eval.batch_size,
                          source=str(checkpoint or source), step=None if policy is None else policy.step,
                          on_batch=bar.update)
    return cfg, report


def describe(cfg: TrainConfig, report: EvalReport) -> str:
    where = cfg.eval.path or (f"{cfg.data.path or cfg.data.name} [{cfg.eval.split}]" if cfg.data.name != "synthetic"
                              else "synthetic problems after the training set's")
    step = "" if report.step is None else f" (step {report.step})"
    lines = [f"{report.source}{step} on {len(report.problems)} held-out problems of {where}:"]
    lines += [f"  {name:<28} {value:.4f}" for name, value in report.metrics().items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with errors_as_messages("error"):
        cfg, report = run_eval(args.source, [*args.overrides, *flag_overrides(args)])
    if args.json == "-":
        json.dump(report.to_dict(), sys.stdout, indent=1)
        print()
        return
    print(describe(cfg, report), flush=True)
    if args.json:
        print(f"  results: {report.write(args.json)}")


if __name__ == "__main__":
    main()
