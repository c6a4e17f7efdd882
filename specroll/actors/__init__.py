"""Ray actors of a training run (rollout, learner, head consolidation) and the driver's view of them."""
from specroll.actor_errors import ActorFailedError, ActorTimeoutError, ClusterLostError

from .batch import Rollouts, prompt_key, split_groups
from .head_consolidation_actor import HeadConsolidationActor
from .learner_actor import LearnerActor, LearnerUpdate
from .placement import actor_device, as_remote
from .remote_calls import gather
from .rollout_actor import RolloutActor
from .run_actors import PendingConsolidation, PendingRollouts, RunActors

__all__ = [
    "ActorFailedError",
    "ActorTimeoutError",
    "ClusterLostError",
    "HeadConsolidationActor",
    "LearnerActor",
    "LearnerUpdate",
    "PendingConsolidation",
    "PendingRollouts",
    "RolloutActor",
    "Rollouts",
    "RunActors",
    "actor_device",
    "as_remote",
    "gather",
    "prompt_key",
    "split_groups",
]
