"""The drafters' running estimates, kept by a speculative decoder between its steps: how far to
believe the heads (their calibration per depth, and by rank and margin where drafts read the
coming draws) and how often the context lookup chain is accepted.

Every step drafts by them (`step.candidates`) and learns them anew (`step.learn`, and the
sync-free step's judged tree); a would-be tree's verdict calibrates the heads too. Heads other than
a later version of those drafting start them afresh at their priors, sized by the trees' depth.
"""
from __future__ import annotations

import torch

from .config import SpeculationConfig
from .drafting.lookup import LookupAcceptance
from .drafting.reading import reading_prior
from .step import Learned, calibrated


class RunningEstimates:
    """The drafters' estimates for trees `depth` deep, at their priors, on `device`."""

    def __init__(self, cfg: SpeculationConfig, depth: int, device) -> None:
        self.context_lookup = cfg.context_lookup
        # Per-depth calibration of head probabilities: observed / predicted acceptance (EMAs).
        self.observed = torch.ones(depth, device=device)
        self.predicted = torch.ones(depth, device=device)
        # Drafts that read the coming draws: how often a child of each rank and margin was the draw.
        self.reading_rate = reading_prior(depth, cfg.max_children, device)
        self.lookup_acceptance = LookupAcceptance(cfg.lookup_ngram, depth, cfg.calibration_momentum, device)

    def calibration(self) -> torch.Tensor:
        """[depth] log(observed / predicted): what the heads' log-probabilities are corrected by."""
        return (self.observed / self.predicted).log()

    def lookup_rate(self) -> torch.Tensor | None:
        """The context lookup chain's acceptance estimates (None: no context lookup)."""
        return self.lookup_acceptance.rate if self.context_lookup else None

    def keep(self, learned: Learned) -> None:
        """Keep what a tree pass taught (`step.learn`)."""
        with torch.inference_mode(False):  # they outlive the generate call
            self.observed, self.predicted = learned.observed.clone(), learned.predicted.clone()
            self.reading_rate = learned.reading_rate.clone()
            if learned.lookup_rate is not None:
                self.lookup_acceptance.rate = learned.lookup_rate.clone()

    def calibrate(self, verdict, live: torch.Tensor, momentum: float) -> None:
        """Calibrate the heads by the `verdict` on the `live` rows of a tree no pass verified (a would-be tree)."""
        with torch.inference_mode(False):  # they outlive the generate call
            self.observed, self.predicted = (t.clone() for t in calibrated(
                self.observed, self.predicted, verdict, live, momentum))
