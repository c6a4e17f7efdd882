"""Waiting on remote calls: every wait has a timeout, and every failure names the actor."""
from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


class ActorFailedError(RuntimeError):
    """A named actor died, raised, or did not answer a remote call in time."""


class ActorTimeoutError(ActorFailedError):
    """A named actor did not answer a remote call within the timeout."""


def reason(exc: RayError) -> str:
    """The cause of an actor's death in one line (Ray's message runs to a page): the
    exception that ended a traceback (e.g. a config error in its constructor), else the summary."""
    lines = [ANSI_ESCAPE.sub("", line).strip() for line in str(exc).splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        return type(exc).__name__
    return lines[-1] if any(line.startswith("File ") for line in lines) else lines[0]


def gather(calls: Sequence[tuple[str, "ray.ObjectRef"]], what: str, timeout_s: float,
           on_result: Callable[[object], None] | None = None) -> list:
    """The results of `calls` (actor name, pending result), in order.

    Results are taken as they arrive (each is passed to `on_result`, e.g. a progress bar), so
    a dead actor is reported as soon as it is found dead, not after the slowest healthy one.
    Raises `ActorFailedError` naming the actor and `what` it was doing, or `ActorTimeoutError`
    naming the actors still silent after `timeout_s`.
    """
    pending = {ref: i for i, (_, ref) in enumerate(calls)}
    results: list = [None] * len(calls)
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            silent = ", ".join(calls[i][0] for i in sorted(pending.values()))
            raise ActorTimeoutError(f"{silent} did not finish {what} within {timeout_s:g} s (cluster.remote_timeout_s)")
        index = pending.pop(ready[0])
        name = calls[index][0]
        try:
            results[index] = ray.get(ready[0])
        except RayActorError as exc:
            raise ActorFailedError(f"{name} died during {what}: {reason(exc)}") from exc
        except RayTaskError as exc:
            cause = exc.cause if exc.cause is not None else exc
            raise ActorFailedError(f"{name} failed in {what}: {type(cause).__name__}: {cause}") from exc
        except RayError as exc:  # e.g. its result was lost, or the task was killed for memory
            raise ActorFailedError(f"{name} failed in {what}: {type(exc).__name__}: {reason(exc)}") from exc
        if on_result is not None:
            on_result(results[index])
    return results
