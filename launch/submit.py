"""Submit a SpecRoll training run to an existing Ray cluster with `ray job submit`.

    python launch/submit.py [--address http://HEAD:8265] [--no-wait] [--env K=V ...] -- [HYDRA OVERRIDES]

    python launch/submit.py -- experiment=paper_gsm8k_qwen2_5_1_5b data.path=/mnt/shared/gsm8k \\
        run_dir=/mnt/shared/runs/paper logger=wandb_online
    python launch/submit.py --env WANDB_API_KEY="$WANDB_API_KEY" -- logger=wandb_online

The repository (this checkout, without .venv, runs, outputs, wandb, .git) is uploaded as the
job's working directory and runs `python -m specroll.train <overrides>` on the head node; the
driver joins the cluster through the job's RAY_ADDRESS. Cluster nodes need SpecRoll's
dependencies (the repository's Dockerfile builds that image). With several nodes, `run_dir`
must be on storage every node sees: each learner rank writes its own part of a checkpoint.

Environment variables given with --env are stored with the job (the dashboard shows them).
A cluster with Ray's token authentication wants RAY_AUTH_MODE=token and its token (in
~/.ray/auth_token or $RAY_AUTH_TOKEN) in the submitting shell.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Never uploaded: environments, run outputs, history (the upload limit is a few hundred MB).
EXCLUDES = [".venv", ".git", "runs", "outputs", "wandb", "*.egg-info", "__pycache__", ".pytest_cache"]
DEFAULT_ADDRESS = "http://127.0.0.1:8265"


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--env takes KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def submit_command(args: argparse.Namespace) -> list[str]:
    runtime_env = {"excludes": EXCLUDES, "env_vars": {"PYTHONUNBUFFERED": "1", **parse_env(args.env)}}
    command = ["ray", "job", "submit", "--address", args.address, "--working-dir", str(REPO),
               "--runtime-env-json", json.dumps(runtime_env)]
    if args.submission_id:
        command += ["--submission-id", args.submission_id]
    if args.no_wait:
        command.append("--no-wait")
    return [*command, "--", "python", "-m", "specroll.train", *args.overrides]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default=os.environ.get("RAY_API_SERVER_ADDRESS") or DEFAULT_ADDRESS,
                        help="the cluster's job server (dashboard) address; default $RAY_API_SERVER_ADDRESS or "
                             f"{DEFAULT_ADDRESS} (e.g. through `ray dashboard launch/cluster_gpu.yaml`)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment variable for the job (repeatable)")
    parser.add_argument("--submission-id", help="the job's id; default: one Ray makes up")
    parser.add_argument("--no-wait", action="store_true", help="return once submitted instead of streaming logs")
    parser.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for specroll.train (after --)")
    args = parser.parse_args(argv)
    command = submit_command(args)
    if args.dry_run:
        print(shlex.join(command))
        return
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
