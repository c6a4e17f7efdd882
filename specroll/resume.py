"""How a launch resumes: the checkpoint it continues from (`cfg.resume`), and what the user is told
to continue with after an actor failed or the run was stopped."""
from __future__ import annotations

import shlex
from pathlib import Path

from specroll.configs import TrainConfig
from specroll.learner import latest_checkpoint, latest_intact_checkpoint, start_branch, verify_checkpoint
from specroll.telemetry import start_wandb_branch


def checkpoint_to_resume(cfg: TrainConfig, checkpoints: Path) -> Path | None:
    """The checkpoint `cfg.resume` names, its files verified against its marker, before any actor starts.

    resume=auto takes the newest intact one (warning about each damaged newer one); an explicit
    path that is damaged raises naming the file rather than falling back to something not asked for.
    """
    newest = latest_checkpoint(checkpoints)
    if cfg.resume == "auto":
        intact = latest_intact_checkpoint(checkpoints)
        if newest is not None and intact is None:
            # Starting afresh would let rotation delete the damaged ones: the user decides.
            raise ValueError(f"resume=auto: no checkpoint under {checkpoints} is intact (see the warnings); "
                             "repair one, pass resume=<path>, or choose a new run_dir")
        return intact
    if cfg.resume == "never":
        if newest is not None:
            raise ValueError(f"resume: run_dir {cfg.run_dir} already holds checkpoints (newest {newest.name}); "
                             "resume=auto continues them, or choose a new run_dir")
        return None
    path = Path(cfg.resume).expanduser()
    verify_checkpoint(path)
    if start_branch(checkpoints, path):
        start_wandb_branch(Path(cfg.run_dir))  # the W&B run of the abandoned history is not continued
    return path


def resume_advice(checkpoints: Path) -> str:
    """What to do after an actor failed mid-run: continue from the newest complete checkpoint, if any."""
    newest = latest_checkpoint(checkpoints)
    if newest:
        return f"the last complete checkpoint is {newest}; run again with resume=auto to continue from it"
    return "no checkpoint was completed yet, so a rerun starts from step 0"


def resume_command(overrides: list[str]) -> str:
    """This launch's command line with resume=auto in place of any resume override."""
    kept = [o for o in overrides if not o.lstrip("+~").startswith("resume=")]
    return shlex.join(["python", "-m", "specroll.train", *kept, "resume=auto"])
