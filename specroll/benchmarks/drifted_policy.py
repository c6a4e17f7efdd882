"""Policy B of the adaptation benchmark when none is given: policy A after a short SFT on the
built-in synthetic worked solutions, made by the SFT command (`specroll.tools.sft`) and cached.

The SFT command writes it atomically (staged, then renamed), with its recipe and command in
`sft_summary.json` beside the weights, and reuses it on the next run. It trains on synthetic
problems from `SKIPPED_PROBLEMS` on: the benchmark's synthetic prompts are the first ones.
"""
from __future__ import annotations

from pathlib import Path

from ..models.loading import cache_root

SKIPPED_PROBLEMS = 256  # the most synthetic prompts a run may use and B not have trained on
# One step of 8192 tokens (the SFT default) at lr 1e-4: frozen heads then draft fewer tokens per pass
# than for A. Three or more steps make B so peaked on the template that they draft more (docs/history/2026-12-06.md).
LIMIT, STEPS, LR = 48, 1, 1e-4  # problems, optimizer steps, lr
RECIPE = ["--dataset", "synthetic", "--skip", str(SKIPPED_PROBLEMS), "--limit", str(LIMIT), "--epochs", "1",
          "--max-steps", str(STEPS), "--lr", str(LR), "--eval-examples", "16"]


def drifted_policy_dir(policy_a: str, root: Path | None = None) -> Path:
    """Where B of policy A is cached: ~/.cache/specroll/sft/<A>-synthetic<LIMIT>-<STEPS>step."""
    name = Path(policy_a).name if Path(policy_a).expanduser().exists() else policy_a.replace("/", "--")
    return (root or cache_root() / "sft") / f"{name}-synthetic{LIMIT}-{STEPS}step"


def build_drifted_policy(policy_a: str, device: str = "auto", threads: int | None = None,
                         root: Path | None = None) -> Path:
    """B's directory, made by the SFT command unless a finished one for this recipe is there."""
    from ..tools import sft

    out = drifted_policy_dir(policy_a, root)
    print(f"policy B: {policy_a} after SFT on synthetic solutions (optimizer steps: {STEPS}, lr {LR}), "
          f"cached in {out}", flush=True)
    sft.main(["--model", policy_a, "--device", device, "--out", str(out), *RECIPE]
             + ([] if threads is None else ["--threads", str(threads)]))
    return out
