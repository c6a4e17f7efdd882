"""Hardware profile: verify-forward latency over batch sizes x nodes per row, and C_hw.

Measures the grid (`specroll.speculation.budgets.hardware_profile`), caches it where the engine reads
profiles, and prints it:

    python -m specroll.tools.profile --model smollm2-135m-instruct [--dtype float32] [--quick]
"""
from __future__ import annotations

import argparse

from specroll.models import load_causal_lm
from specroll.speculation.budgets.hardware_profile import FULL_GRID, QUICK_GRID, HardwareProfile, measure_profile

from .flags import add_policy_flags


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m specroll.tools.profile",
                                 description="Profile verify-forward latency and derive C_hw.")
    add_policy_flags(ap)
    ap.add_argument("--cache-len", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="the 4 x 5 grid the engine measures on first use")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> HardwareProfile:
    args = parse_args(argv)
    model, _ = load_causal_lm(args.model, dtype=args.dtype, device=args.device)
    grid = QUICK_GRID if args.quick else FULL_GRID
    prof = measure_profile(model, args.cache_len, grid["batch_sizes"], grid["nodes"], show_progress=True)
    path = prof.save()
    print(f"\nverify latency (ms), {prof.model} on {prof.device} {prof.dtype}, cache length {prof.cache_len}")
    print("batch \\ nodes " + "".join(f"{n:>9d}" for n in prof.nodes))
    for b, row in zip(prof.batch_sizes, prof.latency_s):
        print(f"{b:>13d} " + "".join(f"{t * 1e3:9.1f}" for t in row))
    print(f"\nC_hw = {prof.capacity} nodes (within {prof.slack}x of a one-token step); saved to {path}")
    return prof


if __name__ == "__main__":
    main()
