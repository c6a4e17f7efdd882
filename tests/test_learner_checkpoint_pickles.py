"""A checkpoint file carrying a pickled payload (an object whose unpickling runs a shell command),
its COMPLETE marker recomputed as an attacker would, is refused naming the file and the type: by
verification, by every loader even unverified, and by `eval`, `export` and `train resume=<path>`
from the command line; the command never runs. A checkpoint saved before `policy.safetensors`
is refused by eval and export saying how to convert it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specroll.eval.__main__ import main as eval_main
from specroll.learner import load_checkpoint, save_checkpoint, verify_checkpoint
from specroll.learner.checkpoint import POLICY_FILE, CompletionMarker, file_records
from specroll.learner.deepspeed_files import deepspeed_state_types
from specroll.learner.lineage import COMPLETE_MARKER
from specroll.speculation.drafting.heads import HeadsMeta
from specroll.speculation.drafting.heads_state import HeadsState
from specroll.storage.safe_load import UnsafeCheckpointError, load_state
from specroll.tools.export import main as export_main
from test_learner_checkpoint import make_learner, random_samples

ROOT = Path(__file__).resolve().parents[1]
CHECKOUT_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


class RunsCommand:
    """Unpickled, it runs `touch marker`: what a downloaded checkpoint could do with any command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def saved_checkpoint(root: Path, zero_stage: int) -> Path:
    """A checkpoint holding every kind of file a run saves: DeepSpeed's, RNG, heads, drafter, history."""
    learner = make_learner(zero_stage)
    learner.update(random_samples(4, seed=1))
    heads = HeadsState(1, {"proj": torch.ones(2, 3)}, HeadsMeta("path", 2, 3, "fingerprint"))
    return save_checkpoint(learner, root, step=1, heads=heads, drafter=[{"weights": torch.zeros(2)}],
                           draft_history=[{"texts": [[1, 2, 3]]}])


def plant_payload(checkpoint: Path, name: str, marker: Path) -> Path:
    """Add a `RunsCommand` to file `name`'s top-level container and recompute the marker over the files."""
    file = checkpoint / name
    state = load_state(file, deepspeed_state_types())
    if isinstance(state, dict):
        state["payload"] = RunsCommand(marker)
    else:
        state.append(RunsCommand(marker))
    torch.save(state, file)
    step = CompletionMarker.read(checkpoint).step
    (checkpoint / COMPLETE_MARKER).write_text(CompletionMarker(step, file_records(checkpoint)).to_json())
    return file


@pytest.mark.parametrize("zero_stage, name", [
    (0, "deepspeed/mp_rank_00_model_states.pt"),  # weights and optimizer state
    (2, "deepspeed/mp_rank_00_model_states.pt"),
    (2, "deepspeed/zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    (3, "deepspeed/zero_pp_rank_0_mp_rank_00_model_states.pt"),
    (3, "deepspeed/zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    (2, "rng_rank0.pt"),
    (2, "heads.pt"),
    (2, "drafter.pt"),
    (2, "draft_history.pt"),
])
def test_a_payload_in_any_file_is_refused_by_verification_and_by_the_loaders(tmp_path, zero_stage, name):
    checkpoint = saved_checkpoint(tmp_path / "checkpoints", zero_stage)
    marker = tmp_path / "payload-ran"
    file = plant_payload(checkpoint, name, marker)

    with pytest.raises(UnsafeCheckpointError, match=f"refusing to load {file}: it names posix.system"):
        verify_checkpoint(checkpoint)
    # The learner ranks load unverified (the driver verified): their loaders refuse it on their own.
    with pytest.raises(UnsafeCheckpointError, match=f"refusing to load {file}: it names posix.system"):
        load_checkpoint(make_learner(zero_stage), checkpoint, verify=False)
    assert not marker.exists()


@pytest.fixture
def planted_run(tmp_path) -> tuple[Path, Path, Path]:
    """A run_dir whose one checkpoint's optimizer states carry a payload: (run_dir, the file, the payload's marker)."""
    run_dir = tmp_path / "run"
    checkpoint = saved_checkpoint(run_dir / "checkpoints", zero_stage=2)
    marker = tmp_path / "payload-ran"
    return run_dir, plant_payload(checkpoint, "deepspeed/zero_pp_rank_0_mp_rank_00_optim_states.pt", marker), marker


def test_eval_and_export_refuse_a_payload_naming_the_file_and_the_type(planted_run, tmp_path):
    run_dir, file, marker = planted_run
    checkpoint = file.parent.parent
    refusal = f"error: refusing to load {file}: it names posix.system"
    for source in (run_dir, checkpoint):
        with pytest.raises(SystemExit, match=refusal):
            eval_main([str(source), "--limit", "1"])
        with pytest.raises(SystemExit, match=refusal):
            export_main([str(source), str(tmp_path / "out")])
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_train_resume_refuses_a_payload_before_ray_starts(planted_run, tmp_path):
    run_dir, file, marker = planted_run
    result = subprocess.run(
        [sys.executable, "-m", "specroll.train", "experiment=smoke", f"run_dir={tmp_path / 'other'}",
         f"resume={file.parent.parent}", "logger.console=false"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**CHECKOUT_ENV, "RAY_TMPDIR": str(tmp_path / "ray"), "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: refusing to load {file}: it names posix.system")
    assert not (tmp_path / "ray").exists()  # refused before Ray started
    assert not marker.exists()


def test_a_checkpoint_without_policy_safetensors_is_refused_saying_how_to_convert(tmp_path):
    checkpoint = saved_checkpoint(tmp_path / "checkpoints", zero_stage=2)
    (checkpoint / POLICY_FILE).unlink()  # as saved before the policy's weights went to safetensors
    (checkpoint / COMPLETE_MARKER).write_text(CompletionMarker(1, file_records(checkpoint)).to_json())
    with pytest.raises(SystemExit, match=f"has no {POLICY_FILE}: .* resume the run from it with this version"):
        export_main([str(checkpoint), str(tmp_path / "out")])
