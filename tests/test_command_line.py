"""What the commands share (`specroll.command_line`): the config tree, $SPECROLL_CONF in its place,
a run config composed from overrides, and errors that name what failed leaving as their message."""
import shutil
from pathlib import Path

import pytest

from specroll.actors import ActorFailedError
from specroll.command_line import compose_train_config, errors_as_messages

CONF = Path(__file__).resolve().parents[1] / "conf"


def test_a_run_config_is_composed_from_the_overrides_a_user_types():
    cfg = compose_train_config(["experiment=smoke", "total_steps=3", "rollout=vanilla"])
    assert cfg.total_steps == 3 and cfg.rollout.mode == "vanilla" and cfg.model.tiny_type is not None


def test_specroll_conf_names_another_config_tree(tmp_path, monkeypatch):
    tree = shutil.copytree(CONF, tmp_path / "conf")
    config = tree / "config.yaml"
    config.write_text(config.read_text().replace("total_steps: 200", "total_steps: 7"))
    assert compose_train_config([]).total_steps == 200
    monkeypatch.setenv("SPECROLL_CONF", str(tree))
    assert compose_train_config([]).total_steps == 7


def test_a_dead_actor_is_reported_as_its_message(monkeypatch):
    failure = ActorFailedError("rollout actor 1 died during load_policy: killed\n  run again with resume=auto")
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exited, errors_as_messages("error"):
        raise failure
    assert exited.value.code == f"error: {failure}" and exited.value.__cause__ is None
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ActorFailedError), errors_as_messages("error"):
        raise failure
    with pytest.raises(KeyError), errors_as_messages("error"):  # an unnamed error (a bug) keeps its traceback
        raise KeyError("x")


@pytest.mark.parametrize("error", [PermissionError(13, "Permission denied", "/runs/x/metrics.jsonl"),
                                   ConnectionError("cannot reach the Ray cluster at 10.0.0.1:6379 (...)"),
                                   FileNotFoundError(2, "No such file or directory", "ray")])
def test_rough_errors_leave_as_their_one_line(monkeypatch, error):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exited, errors_as_messages("error"):
        raise error
    assert exited.value.code == f"error: {error}" and "\n" not in exited.value.code
