"""How a run's actors fail, as errors every command can name in one line without importing Ray."""
from __future__ import annotations


class ActorFailedError(RuntimeError):
    """A named actor died, raised, or did not answer a remote call in time."""


class ActorTimeoutError(ActorFailedError):
    """A named actor did not answer a remote call within the timeout."""


class ClusterLostError(RuntimeError):
    """The Ray cluster itself (its GCS) is gone: no actor is to blame, none can answer."""
