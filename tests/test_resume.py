"""How a launch resumes (`specroll.resume`): the checkpoint `resume` picks, damaged ones passed over
only by resume=auto, and the command and advice a stopped or failed run gives the user."""
import pytest

from specroll.command_line import compose_train_config
from specroll.learner import CheckpointDamagedError, GRPOLearner, LearnerConfig, save_checkpoint
from specroll.models import build_tiny_model
from specroll.resume import checkpoint_to_resume, resume_advice, resume_command


def config(tmp_path, overrides):
    return compose_train_config(["experiment=smoke", f"run_dir={tmp_path / 'run'}", *overrides])


def test_resume_passes_over_a_damaged_checkpoint_only_when_auto(tmp_path):
    checkpoints = tmp_path / "run" / "checkpoints"
    learner = GRPOLearner(build_tiny_model(), LearnerConfig(device="cpu"))
    older, newest = (save_checkpoint(learner, checkpoints, step=step) for step in (1, 2))
    model_states = newest / "deepspeed" / "mp_rank_00_model_states.pt"
    model_states.write_bytes(model_states.read_bytes()[:100])

    with pytest.warns(UserWarning, match="step_00000002 is damaged: deepspeed/mp_rank_00_model_states.pt has 100 bytes"):
        assert checkpoint_to_resume(config(tmp_path, []), checkpoints) == older
    with pytest.raises(CheckpointDamagedError, match="step_00000002 is damaged: deepspeed/mp_rank_00_model_states.pt"):
        checkpoint_to_resume(config(tmp_path, [f"resume={newest}"]), checkpoints)
    with pytest.raises(ValueError, match=r"already holds checkpoints \(newest step_00000002\)"):
        checkpoint_to_resume(config(tmp_path, ["resume=never"]), checkpoints)
    (older / "state.json").unlink()
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="resume=auto: no checkpoint under .* is intact"):
        checkpoint_to_resume(config(tmp_path, []), checkpoints)


def test_a_stopped_launch_is_continued_by_its_own_command_with_resume_auto():
    assert resume_command(["experiment=smoke", "run_dir=/runs/my run", "resume=never", "+resume=x", "seed=3"]) == (
        "python -m specroll.train experiment=smoke 'run_dir=/runs/my run' seed=3 resume=auto")


def test_a_failed_run_is_told_where_to_continue_from(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    assert resume_advice(checkpoints) == "no checkpoint was completed yet, so a rerun starts from step 0"
    saved = save_checkpoint(GRPOLearner(build_tiny_model(), LearnerConfig(device="cpu")), checkpoints, step=1)
    assert resume_advice(checkpoints) == (f"the last complete checkpoint is {saved}; run again with resume=auto to "
                                          "continue from it")
