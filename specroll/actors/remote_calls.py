"""Waiting on remote calls: every wait has a timeout, every failure names the actor that failed,
and a lost Ray cluster is reported as such, not as the death of whichever actor was called."""
from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable, Mapping, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RaySystemError, RayTaskError

from specroll.actor_errors import ActorFailedError, ActorTimeoutError, ClusterLostError

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
# Between two looks at the cluster's GCS: Ray itself ends a process whose GCS stays gone for
# gcs_rpc_server_reconnect_timeout_s (60 s by default), so the loss is named well before.
CLUSTER_CHECK_S = 2.0
CLUSTER_LOST_ERRORS = (RaySystemError, GetTimeoutError, ConnectionError)
# How long the other members of a collective are watched, after one fails, for a death that caused it:
# Ray learns of a killed or crashed process within about a second, of a lost node within its health checks.
DEATH_GRACE_S = 20.0
DEATH_CAUSE = "The actor is dead because"  # the line of Ray's message saying why (killed, out of memory, its node died)


def reason(exc: BaseException) -> str:
    """The cause of an actor's death in one line (Ray's message runs to a page): the
    exception that ended a traceback (e.g. a config error in its constructor), else the summary."""
    lines = [ANSI_ESCAPE.sub("", line).strip() for line in str(exc).splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        return type(exc).__name__
    return lines[-1] if any(line.startswith("File ") for line in lines) else lines[0]


def actor_names(handles: Mapping[str, object]) -> dict[str, str]:
    """{actor id (hex): name} of `handles` ({name: actor handle}), for `gather` to name the dead."""
    return {handle._actor_id.hex(): name for name, handle in handles.items() if handle is not None}


def cluster_reachable() -> bool:
    """Whether this process still reaches its Ray cluster's GCS (True where it cannot tell, e.g. Ray Client)."""
    try:
        address = ray.get_runtime_context().gcs_address
    except Exception:  # no GCS address to look at (Ray Client, or not connected)
        return True
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CLUSTER_CHECK_S).close()
    except OSError:
        return False
    return True


def lost(what: str, detail: str) -> ClusterLostError:
    return ClusterLostError(f"the Ray cluster was lost during {what}: {detail}")


def died(exc: RayActorError, called: str, what: str, names: Mapping[str, str]) -> ActorFailedError:
    """The death `exc` reports, naming the actor that died (by its id), which need not be the one called:
    a call waiting on a dead actor's result fails with that actor's death."""
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, RayActorError):
        exc = exc.cause  # the dead actor's own error, without the header of the call that waited on it
    dead = names.get(exc.actor_id or "", called)
    found = "" if dead == called else f" (found through {called}'s call)"
    said = reason(exc)
    why = [line for line in map(str.strip, str(exc).splitlines()) if line.startswith(DEATH_CAUSE) and line != said]
    return ActorFailedError(f"{dead} died during {what}{found}: {said}{' ' + why[0] if why else ''}")


def gather(calls: Sequence[tuple[str, "ray.ObjectRef"]], what: str, timeout_s: float,
           on_result: Callable[[object], None] | None = None, names: Mapping[str, str] | None = None,
           collective: bool = False) -> list:
    """The results of `calls` (actor name, pending result), in order.

    Results are taken as they arrive (each is passed to `on_result`, e.g. a progress bar), so
    a dead actor is reported as soon as it is found dead, not after the slowest healthy one.
    Raises `ActorFailedError` naming the actor and `what` it was doing (the dead actor by its id
    in `names`, {actor id: name}, from `actor_names`), `ActorTimeoutError` naming the actors still
    silent after `timeout_s`, or `ClusterLostError` once the cluster's GCS cannot be reached.
    `collective`: the calls are members of one collective, where a member's death fails the others'
    calls too (a closed connection) and perhaps first: a call that fails is reported as the death of
    another member found within `DEATH_GRACE_S`, where one is.
    """
    names = names or {}
    pending = {ref: i for i, (_, ref) in enumerate(calls)}
    results: list = [None] * len(calls)
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        try:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, min(left, CLUSTER_CHECK_S)))
        except CLUSTER_LOST_ERRORS as exc:
            raise lost(what, f"{type(exc).__name__}: {reason(exc)}") from exc
        if not ready:
            if not cluster_reachable():
                raise lost(what, "its GCS no longer answers")
            if left > CLUSTER_CHECK_S:
                continue
            silent = ", ".join(calls[i][0] for i in sorted(pending.values()))
            raise ActorTimeoutError(f"{silent} did not finish {what} within {timeout_s:g} s (cluster.remote_timeout_s)")
        index = pending.pop(ready[0])
        name = calls[index][0]
        try:
            results[index] = ray.get(ready[0])
        except RayActorError as exc:
            if not cluster_reachable():  # every actor is unreachable when the GCS is gone
                raise lost(what, f"its GCS no longer answers ({name}: {reason(exc)})") from exc
            raise died(exc, name, what, names) from exc
        except RayTaskError as exc:
            cause = exc.cause if exc.cause is not None else exc
            if isinstance(cause, RayActorError):
                raise died(cause, name, what, names) from exc
            if collective:
                death_among(calls, pending, what, names)
            raise ActorFailedError(f"{name} failed in {what}: {type(cause).__name__}: {cause}") from exc
        except CLUSTER_LOST_ERRORS as exc:
            raise lost(what, f"{type(exc).__name__}: {reason(exc)}") from exc
        except RayError as exc:  # e.g. its result was lost, or the task was killed for memory
            raise ActorFailedError(f"{name} failed in {what}: {type(exc).__name__}: {reason(exc)}") from exc
        if on_result is not None:
            on_result(results[index])
    return results


def death_among(calls: Sequence[tuple[str, "ray.ObjectRef"]], pending: dict, what: str,
                names: Mapping[str, str]) -> None:
    """Raise the death of the first of the `pending` calls found dead within `DEATH_GRACE_S`; return if none is."""
    deadline = time.monotonic() + DEATH_GRACE_S
    while pending and time.monotonic() < deadline:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            return
        index = pending.pop(ready[0])
        try:
            ray.get(ready[0])
        except RayActorError as exc:
            raise died(exc, calls[index][0], what, names) from exc
        except RayTaskError as exc:
            if isinstance(exc.cause, RayActorError):
                raise died(exc.cause, calls[index][0], what, names) from exc
