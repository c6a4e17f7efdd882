"""Submit a SpecRoll training run to a Ray cluster's job server, as `ray job submit` does.

    python launch/submit.py [--address http://HEAD:8265] [--python PATH] [--env NAME ...] [--no-wait]
        [--dry-run] -- run_dir=/SHARED/ABSOLUTE/PATH [HYDRA OVERRIDES]

    python launch/submit.py --env WANDB_API_KEY -- experiment=paper_gsm8k_qwen2_5_1_5b \\
        data.path=/mnt/shared/gsm8k run_dir=/mnt/shared/runs/paper logger=wandb_online
    python launch/submit.py --python "$PWD/.venv/bin/python" -- experiment=smoke run_dir=/tmp/runs/smoke

run_dir is required, as an absolute path on storage every node sees: a relative one
would land in the job's working directory, which Ray unpacks under a new name whenever the
uploaded files differ, so a resubmission after an edit would silently start over. Submitted
again with the same run_dir, a run resumes from its newest checkpoint (resume=auto).

The job uploads this checkout (without .venv, .git, runs, outputs, wandb) as its working
directory and runs `<python> -m specroll.train <overrides>` on the head node; the driver joins
the cluster through the job's RAY_ADDRESS. <python> must have SpecRoll's dependencies: the
default, `python` on the head's PATH, is the Docker image's (launch/cluster_gpu.yaml); a head
started from a virtualenv (`.venv/bin/ray start --head`) wants that one: --python /abs/.venv/bin/python.

Secrets: --env NAME hands $NAME of this shell to the job. Values go to the job server in the
request body, never onto a command line (visible in `ps`) nor into --dry-run's output; the
server keeps them with the job's runtime environment, which its dashboard shows to whoever
reaches it (launch/cluster_gpu.yaml binds it to the head's localhost: reach it through
`ray dashboard`). A cluster with Ray's token authentication wants RAY_AUTH_MODE=token and its
token (~/.ray/auth_token or $RAY_AUTH_TOKEN) in the submitting shell.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Never uploaded: environments, run outputs, history (the upload limit is a few hundred MB).
EXCLUDES = [".venv", ".git", "runs", "outputs", "wandb", "*.egg-info", "__pycache__", ".pytest_cache"]
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
RUN_DIR_OVERRIDE = re.compile(r"^\+{0,2}run_dir=(.*)$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class JobRequest:
    """What is sent to the job server: the command the job runs and its runtime environment."""

    entrypoint: str  # a shell command on the head node
    runtime_env: dict  # working_dir, excludes, env_vars (secret values included)
    run_dir: str
    secrets: tuple[str, ...] = ()  # names of env_vars whose values are never printed

    def describe(self, address: str) -> str:
        env = self.runtime_env["env_vars"]
        shown = {k: f"<${k} of the submitting shell>" if k in self.secrets else v for k, v in env.items()}
        return "\n".join([
            f"job server:  {address}",
            f"runs:        {self.entrypoint}",
            f"working dir: {self.runtime_env['working_dir']} (without {', '.join(self.runtime_env['excludes'])})",
            f"environment: {', '.join(f'{k}={v}' for k, v in shown.items())}",
            f"run_dir:     {self.run_dir} (must be on storage every node sees; submitting again with this "
            "run_dir resumes the run)",
        ])


def required_run_dir(overrides: list[str]) -> str:
    """The run_dir the overrides set; exits with the reason when it is missing or not absolute."""
    values = [m.group(1).strip("'\"") for o in overrides if (m := RUN_DIR_OVERRIDE.match(o))]
    if not values:
        raise SystemExit("submit.py needs run_dir=<absolute path on storage every node sees> among the overrides "
                         "(e.g. run_dir=/mnt/shared/runs/NAME): the presets' relative run_dir would land in the "
                         "job's own working directory, lost to the next submission")
    if not values[-1].startswith("/"):
        raise SystemExit(f"run_dir={values[-1]} must be an absolute path on storage every node sees: a relative "
                         "(or ~) path lands in Ray's per-job copy of this checkout (.../_ray_pkg_<hash>/), "
                         "which a resubmission after an edit does not see")
    return values[-1]


def forwarded_env(names: list[str], environ: Mapping[str, str]) -> dict[str, str]:
    """$NAME of this shell for each --env NAME; exits naming any that is malformed or unset."""
    env = {}
    for name in names:
        if not ENV_NAME.match(name):
            key = name.partition("=")[0]  # never echo a value
            raise SystemExit(f"--env takes a variable's name (--env {key}), not {key}=<value>: a value on the "
                             "command line shows in `ps`; set it in the shell instead")
        if name not in environ:
            raise SystemExit(f"--env {name}: ${name} is not set in this shell")
        env[name] = environ[name]
    return env


def job_request(args: argparse.Namespace, environ: Mapping[str, str]) -> JobRequest:
    """The job the arguments ask for; exits with the reason when it would lose the run or leak a secret."""
    if "/" in args.python and not args.python.startswith("/"):
        raise SystemExit(f"--python {args.python} must be absolute or a name on the head's PATH: the job runs "
                         "in Ray's copy of this checkout, without .venv")
    run_dir = required_run_dir(args.overrides)
    secrets = forwarded_env(args.env, environ)
    runtime_env = {"working_dir": str(REPO), "excludes": EXCLUDES,
                   "env_vars": {"PYTHONUNBUFFERED": "1", **secrets}}
    entrypoint = shlex.join([args.python, "-m", "specroll.train", *args.overrides])
    return JobRequest(entrypoint, runtime_env, run_dir, tuple(secrets))


async def print_logs(client, job_id: str) -> bool:
    """Stream the job's logs; True if its Python lacked a module."""
    missing_module = False
    async for lines in client.tail_job_logs(job_id):
        print(lines, end="", flush=True)
        missing_module |= "ModuleNotFoundError" in lines
    return missing_module


def submit(request: JobRequest, args: argparse.Namespace) -> int:
    """Submit the job and, unless --no-wait, stream its logs; the exit status is the job's."""
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobStatus, JobSubmissionClient

    try:
        client = JobSubmissionClient(args.address)
    except (ConnectionError, AuthenticationError) as exc:
        raise SystemExit(f"cannot use the job server at {args.address}: {exc}") from None
    job_id = client.submit_job(entrypoint=request.entrypoint, runtime_env=request.runtime_env,
                               submission_id=args.submission_id)
    follow = f"ray job logs --address {args.address} -f {job_id}"
    print(f"submitted job {job_id}; run_dir {request.run_dir}", flush=True)
    if args.no_wait:
        print(f"follow it: {follow}")
        return 0
    try:
        missing_module = asyncio.run(print_logs(client, job_id))
    except KeyboardInterrupt:
        print(f"\nstopped following; the job runs on ({follow}; ray job stop {job_id} ends it)")
        return 130
    status = client.get_job_status(job_id)
    print(f"job {job_id} {status.value.lower()}")
    if missing_module and status != JobStatus.SUCCEEDED:
        print(f"the head's {args.python} lacks SpecRoll's dependencies: pass --python with the absolute path "
              "of the Python that has them (a head started from a virtualenv: that virtualenv's bin/python)")
    return 0 if status == JobStatus.SUCCEEDED else 1


def argument_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default=environ.get("RAY_API_SERVER_ADDRESS") or DEFAULT_ADDRESS,
                        help="the cluster's job server (dashboard) address; default $RAY_API_SERVER_ADDRESS or "
                             f"{DEFAULT_ADDRESS} (e.g. through `ray dashboard launch/cluster_gpu.yaml`)")
    parser.add_argument("--python", default="python",
                        help="the head node's Python with SpecRoll's dependencies (default: `python` on its PATH)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME",
                        help="hand $NAME of this shell to the job, e.g. WANDB_API_KEY (repeatable)")
    parser.add_argument("--submission-id", help="the job's id; default: one Ray makes up")
    parser.add_argument("--no-wait", action="store_true", help="return once submitted instead of streaming logs")
    parser.add_argument("--dry-run", action="store_true", help="print what would be submitted (no secret values)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for specroll.train (after --)")
    return parser


def main(argv: list[str] | None = None, environ: Mapping[str, str] = os.environ) -> int:
    args = argument_parser(environ).parse_args(argv)
    request = job_request(args, environ)
    print(request.describe(args.address), flush=True)
    return 0 if args.dry_run else submit(request, args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
