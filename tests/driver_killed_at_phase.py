"""The driver of a training run, SIGKILLed as a step's phase begins: the fault tests' dead driver.

    python tests/driver_killed_at_phase.py STEP PHASE OVERRIDE...

Runs `run_training` on `experiment=...` overrides (Hydra, conf/ of this checkout) and kills its
own process, with no chance to clean up, as phase PHASE of step STEP begins; prints the first
step it runs ("first step N").
"""
import os
import signal
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from specroll.configs import load_train_config
from specroll.train import STEP_PHASES, run_training

CONF = Path(__file__).resolve().parents[1] / "conf"


def main(step: int, phase: str, overrides: list[str]) -> None:
    if phase not in STEP_PHASES:
        raise SystemExit(f"phase must be one of {STEP_PHASES}, got {phase!r}")
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = load_train_config(compose("config", overrides=overrides))

    seen = []

    def die(at_step: int, at_phase: str, actors) -> None:
        if not seen:
            print(f"first step {at_step}", flush=True)  # where this launch resumed
        seen.append(at_step)
        if (at_step, at_phase) == (step, phase):
            os.kill(os.getpid(), signal.SIGKILL)

    run_training(cfg, on_phase=die)
    raise SystemExit(f"the run ended without reaching {phase} of step {step}")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3:])
