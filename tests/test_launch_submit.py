"""launch/submit.py builds the job it sends: an absolute run_dir on shared storage required, the
interpreter it names, secrets in the job's environment but never on a command line or in --dry-run."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("launch_submit", ROOT / "launch" / "submit.py")
submit = sys.modules["launch_submit"] = importlib.util.module_from_spec(spec)  # a script, not a package module
spec.loader.exec_module(submit)

SECRET = "wandb-key-0123456789"
SHELL = {"WANDB_API_KEY": SECRET, "WANDB_MODE": "online"}


def job(argv: list[str]):
    return submit.job_request(submit.argument_parser(SHELL).parse_args(argv), SHELL)


def test_the_job_runs_the_named_python_on_an_absolute_run_dir_with_the_secrets_in_its_environment():
    request = job(["--python", "/opt/venv/bin/python", "--env", "WANDB_API_KEY", "--env", "WANDB_MODE", "--",
                   "experiment=smoke", "run_dir=/mnt/shared/runs/smoke", "logger.run_name=it's mine"])
    assert request.entrypoint == ("/opt/venv/bin/python -m specroll.train experiment=smoke "
                                  "run_dir=/mnt/shared/runs/smoke 'logger.run_name=it'\"'\"'s mine'")
    assert request.run_dir == "/mnt/shared/runs/smoke"
    assert request.runtime_env["env_vars"] == {"PYTHONUNBUFFERED": "1", "WANDB_API_KEY": SECRET, "WANDB_MODE": "online"}
    assert request.runtime_env["working_dir"] == str(ROOT) and ".venv" in request.runtime_env["excludes"]
    assert SECRET not in request.entrypoint
    assert job(["--", "run_dir=/mnt/a"]).entrypoint == "python -m specroll.train run_dir=/mnt/a"  # the image's python


def test_dry_run_shows_the_job_but_no_secret_value(capsys):
    assert submit.main(["--dry-run", "--env", "WANDB_API_KEY", "--", "run_dir=/mnt/shared/runs/a"], SHELL) == 0
    shown = capsys.readouterr().out
    assert SECRET not in shown
    assert "WANDB_API_KEY=<$WANDB_API_KEY of the submitting shell>" in shown
    assert "run_dir:     /mnt/shared/runs/a (must be on storage every node sees" in shown
    assert "runs:        python -m specroll.train run_dir=/mnt/shared/runs/a" in shown


@pytest.mark.parametrize("argv, message", [
    (["--", "experiment=smoke"], "needs run_dir=<absolute path on storage every node sees>"),
    (["--", "run_dir=runs/smoke"], r"run_dir=runs/smoke must be an absolute path .*_ray_pkg_<hash>"),
    (["--", "run_dir=/mnt/a", "run_dir=~/runs"], r"run_dir=~/runs must be an absolute path"),  # the last one counts
    (["--env", f"WANDB_API_KEY={SECRET}", "--", "run_dir=/mnt/a"], "--env takes a variable's name"),
    (["--env", "HF_TOKEN", "--", "run_dir=/mnt/a"], r"--env HF_TOKEN: \$HF_TOKEN is not set in this shell"),
    (["--python", ".venv/bin/python", "--", "run_dir=/mnt/a"], "must be absolute or a name on the head's PATH"),
])
def test_what_would_lose_the_run_or_leak_a_secret_is_refused_before_submitting(argv, message):
    with pytest.raises(SystemExit, match=message) as refused:
        job(argv)
    assert SECRET not in str(refused.value)


def test_hydra_append_forms_of_run_dir_count():
    assert job(["--", "++run_dir=/mnt/b"]).run_dir == "/mnt/b"
    assert job(["--", "+run_dir='/mnt/c'"]).run_dir == "/mnt/c"
