"""Two runs side by side: whether they sampled the same responses, and what each learned.

    python -m specroll.tools.compare_runs runs/learning runs/learning_vanilla --plot learning.png

Both runs log their responses with `logger.rollouts=true`. Run with the same seed, a speculative run
samples the vanilla run's responses token for token (coupled draws), so its updates, rewards and
evaluations are the vanilla run's too. Printed: per step the share of identical responses and each
run's mean reward, then each held-out evaluation (run_dir/evals/); `--plot` draws both runs' learning
curves, `--json` writes the comparison.
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
    p.add_argument("run_a", help="a run_dir with rollouts.jsonl (logger.rollouts=true)")
    p.add_argument("run_b", help="the other run_dir")
    p.add_argument("--plot", metavar="PNG", help="draw both runs' reward and held-out accuracy curves")
    p.add_argument("--json", metavar="PATH", help="write the comparison as JSON")
    return p.parse_args(argv)


def run_names(run_a: str, run_b: str) -> tuple[str, str]:
    """The runs' folder names, or their paths where those coincide."""
    a, b = Path(run_a), Path(run_b)
    return (a.name, b.name) if a.name != b.name else (str(a), str(b))


def report(args: argparse.Namespace, steps: list[StepComparison]) -> dict:
    names = run_names(args.run_a, args.run_b)
    total = sum(s.responses for s in steps)
    identical = sum(s.identical for s in steps)
    print(f"{'step':>5} {'identical':>10} {'prompts':>8} {'reward ' + names[0]:>20} {'reward ' + names[1]:>20}")
    for s in steps:
        print(f"{s.step:>5} {s.identical:>4}/{s.responses:<5} {'same' if s.same_prompts else 'DIFFER':>8} "
              f"{s.reward_a:>20.3f} {s.reward_b:>20.3f}")
    first_fork = next((s.step for s in steps if s.identical < s.responses or not s.same_prompts), None)
    print(f"identical responses: {identical}/{total} ({identical / max(total, 1):.1%}) over {len(steps)} steps; "
          + ("none differ" if first_fork is None else f"the first difference is at step {first_fork}"))
    curves = {name: held_out_curve(run) for name, run in zip(names, (args.run_a, args.run_b))}
    for name, curve in curves.items():
        print(f"held-out accuracy, {name}: " + (", ".join(f"{a:.3f} ({u} updates)" for u, a in curve) or "none"))
    return {"runs": dict(zip(names, (args.run_a, args.run_b))), "identical": identical, "responses": total,
            "first_difference_step": first_fork, "steps": [s._asdict() for s in steps], "held_out": curves}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    steps = compare_runs(read_rollouts(args.run_a), read_rollouts(args.run_b))
    if not steps:
        raise ValueError(f"{args.run_a} and {args.run_b} logged no step in common")
    out = report(args, steps)
    if args.plot:
        names = run_names(args.run_a, args.run_b)
        plot_learning_curves(dict(zip(names, (args.run_a, args.run_b))), args.plot, title=" and ".join(names))
        print(f"curves: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    with errors_as_messages(COMMAND):
        main()
