"""Runs side by side: whether they sampled the same responses, and what each learned.

    python -m specroll.tools.compare_runs runs/learning runs/learning_vanilla --plot learning.png
    python -m specroll.tools.compare_runs runs/grpo runs/gspo runs/cispo --label GRPO --label GSPO --label CISPO

Every run logs its responses with `logger.rollouts=true`. Run with the same seed, a speculative run
samples the vanilla run's responses token for token (coupled draws), so its updates, rewards and
evaluations are the vanilla run's too. Each run after the first is compared with the first. Printed:
per step how many of each later run's responses equal the first run's and each run's mean reward,
then each held-out evaluation (run_dir/evals/); `--plot` draws every run's learning curves in one
figure, a legend naming each run (`--label`, default the folder names), `--json` writes the comparison.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import NamedTuple

from specroll.command_line import errors_as_messages
from specroll.telemetry.history import held_out_curve
from specroll.telemetry.plots import plot_learning_curves
from specroll.telemetry.rollout_log import StepRollouts, read_rollouts

COMMAND = "python -m specroll.tools.compare_runs"


class StepComparison(NamedTuple):
    step: int
    responses: int
    identical: int  # responses with the same tokens in both runs
    same_prompts: bool
    reward_a: float
    reward_b: float


def compare_step(a: StepRollouts, b: StepRollouts) -> StepComparison:
    identical = sum(x == y for x, y in zip(a.response_ids, b.response_ids))
    return StepComparison(a.step, max(len(a.response_ids), len(b.response_ids)), identical,
                          a.prompt_ids == b.prompt_ids, mean(a.rewards), mean(b.rewards))


def compare_runs(a: dict[int, StepRollouts], b: dict[int, StepRollouts]) -> list[StepComparison]:
    """The steps both runs logged, in order."""
    return [compare_step(a[step], b[step]) for step in sorted(a.keys() & b.keys())]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN_DIR",
                   help="two or more run_dirs with rollouts.jsonl (logger.rollouts=true); the first is the reference")
    p.add_argument("--label", action="append", metavar="NAME",
                   help="a run's name in the printout and the legend, once per run in order (default: folder names)")
    p.add_argument("--plot", metavar="PNG", help="draw every run's reward and held-out accuracy curves")
    p.add_argument("--json", metavar="PATH", help="write the comparison as JSON")
    args = p.parse_args(argv)
    if len(args.runs) < 2:
        p.error("compare two runs or more")
    if args.label is not None and (len(args.label) != len(args.runs) or len(set(args.label)) != len(args.label)):
        p.error(f"--label: {len(args.runs)} distinct names, one per run, got {args.label}")
    return args


def run_names(run_dirs: list[str]) -> list[str]:
    """The runs' folder names, or their paths where those coincide."""
    names = [Path(run).name for run in run_dirs]
    return names if len(set(names)) == len(names) else [str(Path(run)) for run in run_dirs]


def print_steps(first: str, against: dict[str, list[StepComparison]]) -> None:
    """Per step: each later run's responses equal to the first run's, then every run's mean reward."""
    steps = sorted(set.intersection(*({s.step for s in c} for c in against.values())))
    rows = {name: {s.step: s for s in c} for name, c in against.items()}
    names = [first, *against]
    print(f"{'step':>5} " + " ".join(f"{'identical ' + n:>24}" for n in against) + " "
          + " ".join(f"{'reward ' + n:>20}" for n in names))
    for step in steps:
        same = [rows[n][step] for n in against]
        cells = [f"{s.identical}/{s.responses}" + ("" if s.same_prompts else " DIFFER") for s in same]
        rewards = [same[0].reward_a, *(s.reward_b for s in same)]
        print(f"{step:>5} " + " ".join(f"{c:>24}" for c in cells) + " " + " ".join(f"{r:>20.3f}" for r in rewards))


def identity(steps: list[StepComparison]) -> dict:
    """How many responses two runs share over their common steps, and the first step where they part."""
    first_fork = next((s.step for s in steps if s.identical < s.responses or not s.same_prompts), None)
    return {"identical": sum(s.identical for s in steps), "responses": sum(s.responses for s in steps),
            "first_difference_step": first_fork, "steps": [s._asdict() for s in steps]}


def report(runs: dict[str, str], against: dict[str, list[StepComparison]]) -> dict:
    """Printed and returned: each later run's responses against the first's, every run's held-out curve."""
    first = next(iter(runs))
    print_steps(first, against)
    same = {name: identity(steps) for name, steps in against.items()}
    for name, s in same.items():
        print(f"identical responses, {name} and {first}: {s['identical']}/{s['responses']} "
              f"({s['identical'] / max(s['responses'], 1):.1%}) over {len(s['steps'])} steps; "
              + ("none differ" if s["first_difference_step"] is None
                 else f"the first difference is at step {s['first_difference_step']}"))
    curves = {name: held_out_curve(run) for name, run in runs.items()}
    for name, curve in curves.items():
        print(f"held-out accuracy, {name}: " + (", ".join(f"{a:.3f} ({u} updates)" for u, a in curve) or "none"))
    return {"runs": runs, "identity": same, "held_out": curves}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    runs = dict(zip(args.label or run_names(args.runs), args.runs))
    first, *later = runs.items()
    logged = read_rollouts(first[1])
    against = {name: compare_runs(logged, read_rollouts(run)) for name, run in later}
    for name, steps in against.items():
        if not steps:
            raise ValueError(f"{first[1]} and {runs[name]} logged no step in common")
    out = report(runs, against)
    if args.plot:
        plot_learning_curves(runs, args.plot, title=", ".join(runs))
        print(f"curves: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    with errors_as_messages(COMMAND):
        main()
