"""What the `python -m specroll...` commands share: the Hydra config tree, a run config composed
from the overrides a user types, overrides renamed since earlier runs refused, and errors that
name what failed reported as their one-line message.

The Hydra tree is `conf/` next to the package, or the directory in $SPECROLL_CONF.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hydra import compose, initialize_config_dir

from specroll.actor_errors import ActorFailedError, ClusterLostError
from specroll.configs import TrainConfig, load_train_config
from specroll.configs.renames import renamed_overrides
from specroll.run_owner import RunDirOwnedError

CONF_ENV = "SPECROLL_CONF"
FULL_ERROR_ENV = "HYDRA_FULL_ERROR"  # Hydra's own switch for full tracebacks, kept for ours
# Errors whose message names what failed (a config field, a file or folder, the Ray address, an actor, a lost
# cluster): a traceback adds nothing. OSError holds PermissionError, FileNotFoundError and ConnectionError.
REPORTED_ERRORS = (ValueError, OSError, ActorFailedError, ClusterLostError, RunDirOwnedError)


def conf_dir() -> str:
    return os.environ.get(CONF_ENV) or str(Path(__file__).resolve().parents[1] / "conf")


def compose_train_config(overrides: list[str]) -> TrainConfig:
    """The run config that `python -m specroll.train <overrides>` runs with."""
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        return load_train_config(compose("config", overrides=overrides))


def refuse_renamed(overrides: list[str]) -> None:
    """Stop, naming the new spelling, where an override uses a key or value renamed since earlier runs."""
    renamed = renamed_overrides(overrides)
    if renamed:
        raise SystemExit("invalid config: renamed since earlier runs (docs/guide.md, Changelog):\n  " + "\n  ".join(renamed))


@contextmanager
def errors_as_messages(prefix: str) -> Iterator[None]:
    """A `REPORTED_ERRORS` error leaves as `prefix: message` on stderr and exit status 1, without the
    traceback Hydra would print first; with HYDRA_FULL_ERROR=1 it propagates, traceback and all."""
    try:
        yield
    except REPORTED_ERRORS as exc:
        if os.environ.get(FULL_ERROR_ENV) == "1":
            raise
        raise SystemExit(f"{prefix}: {exc}") from None
