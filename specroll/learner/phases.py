"""Named phases of a learner step, as torch.profiler ranges (nearly free when nothing profiles)."""
from __future__ import annotations

import torch

# In the order a micro-batch meets them; `learner_floor` splits a step's time along them.
PHASES = ("forward", "logprobs", "loss", "backward", "optimizer_step")
PREFIX = "learner/"


def phase(name: str) -> torch.profiler.record_function:
    """A profiler range named `learner/<name>` around one phase of the step."""
    if name not in PHASES:
        raise ValueError(f"unknown learner phase {name!r}; phases: {PHASES}")
    return torch.profiler.record_function(PREFIX + name)
