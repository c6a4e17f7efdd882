"""The cost model's running estimates: how many nodes a step drafts, and what its drafts cost.

With the `cost_model` budget the running estimates plan each step's budget before it drafts, so a
step drafts only the tree it can use; its drafts then pick N_t (`policies.cost_model_budget`).
Probes that draft the full tree refresh the estimates of larger trees (of every tree, where none
pays): every DRAFT_PROBE_EVERY steps where the heads' typical acceptance (a slow average) would
pay at this batch size, so a passing dip stops speculation only briefly; elsewhere every
RARE_PROBE_EVERY, since a full draft costs a good share of a large batch's step. The plan is the
largest tree whose estimated rate is within PLAN_SLACK of the best: nearby sizes estimate close to
each other, and planning the best one picked small trees that emitted less. While it decodes
plain, what would-be trees realised (`note_would_be`) moves the expected tokens too.
"""
from __future__ import annotations

import torch

from .policies import cost_model_budget, speculation_may_pay
from .hardware_profile import HardwareProfile

PLAN_SLACK = 0.9
DRAFT_PROBE_EVERY = 4
RARE_PROBE_EVERY = 16
TYPICAL_MOMENTUM = 0.98
COST_MODEL_MOMENTUM = 0.8


class CostModel:
    """Plans each step's drafts for trees of 1..`max_nodes` nodes on `profile`'s verify latency
    and EMAs of what drafting and a step's own work cost, and of the tokens each tree size is
    expected to emit per row; trees of `depth` depths at most (the decoder's `depth`). `min_gain`: a
    tree must beat plain decoding's estimated rate by this fraction."""

    def __init__(self, profile: HardwareProfile, depth: int, min_nodes: int, max_nodes: int,
                 min_gain: float) -> None:
        self.profile = profile
        self.min_nodes, self.max_nodes, self.min_gain = min_nodes, max_nodes, min_gain
        # EMA of drafting seconds by the depth drafted (index 0: no drafting), and of what a plain
        # step and a tree step cost beyond their profiled forwards (None: not seen yet).
        self.draft_s: list[float] = []  # sized by `restart`
        self.plain_extra_s: float | None = None
        self.tree_extra_s: float | None = None
        self.restart(depth)

    def restart(self, depth: int) -> None:
        """Forget how well the heads draft (other heads, trees of `depth` depths): the drafting and
        step-time EMAs stay, they measure the hardware, resized to the depths drafted now (a
        deeper one not seen yet, a shallower one's deeper entries dropped)."""
        self.depth = depth
        self.draft_s = (self.draft_s + [0.0] * (depth + 1))[: depth + 1]
        # EMA over drafted steps of the mean expected tokens per row for N = 1..max_nodes.
        self.expected_per_row: torch.Tensor | None = None
        self.typical_per_row: torch.Tensor | None = None  # the same, averaged slowly
        self.steps_since_full_draft = 0

    def planned_drafts(self, batch: int) -> int:
        """How many nodes this step drafts (0: a plain step). Where a tree pays by the running
        estimates, the largest one within PLAN_SLACK of the best; now and then the full tree as
        a probe (see DRAFT_PROBE_EVERY); none where not even perfect drafts could pay."""
        full, least = self.max_nodes - 1, self.min_nodes - 1
        if not speculation_may_pay(self.profile, batch, self.max_nodes, self.depth, self.drafting_s()):
            # Where only the measured drafting time rules speculation out, still probe rarely: that
            # time can fall (a first draft on a GPU loads kernels), and one slow draft must not end drafting.
            probe = (max(self.draft_s) > 0 and self.steps_since_full_draft >= RARE_PROBE_EVERY
                     and speculation_may_pay(self.profile, batch, self.max_nodes, self.depth))
            return full if probe else least
        if self.expected_per_row is None:
            return full  # nothing drafted yet: draft to find out
        pays = self.best_budget(self.expected_per_row, batch) > 1
        planned = max(self.best_budget(self.expected_per_row, batch, PLAN_SLACK) - 1 if pays else 0, least)
        if planned == full:
            return full
        if planned > 0:  # its own drafts keep this tree's estimates fresh; larger ones can wait
            probe_every = RARE_PROBE_EVERY
        elif self.best_budget(self.typical_per_row, batch) > 1:
            probe_every = DRAFT_PROBE_EVERY
        else:
            probe_every = RARE_PROBE_EVERY
        return full if self.steps_since_full_draft >= probe_every else planned

    def best_budget(self, expected_per_row: torch.Tensor, batch: int, slack: float = 1.0) -> int:
        """The N that `batch` rows expecting these tokens per N would get (see cost_model_budget)."""
        expected = expected_per_row.expand(batch, -1)
        return cost_model_budget(expected, self.profile, batch, 1, self.max_nodes, self.drafting_s(), slack,
                                 self.min_gain)

    def drafted(self, cands, drafts: int, batch: int, seconds: float) -> int:
        """Note a step's drafting (`drafts` nodes as `cands` in `seconds`; 0: none) and pick its N_t
        from its drafts, never above what was drafted (1 where nothing was)."""
        if drafts == 0:
            self.steps_since_full_draft += 1
            return 1
        self.note_drafted(cands, drafts, seconds)
        return cost_model_budget(cands.expected_tokens(drafts + 1), self.profile, batch, self.min_nodes, drafts + 1,
                                 self.drafting_s(), min_gain=self.min_gain)

    def drafting_s(self) -> list[float]:
        """Estimated seconds a tree of 1..max_nodes nodes costs beyond its profiled verify forward:
        its drafting (a tree of n nodes drafts min(n - 1, depth) depths: the EMA for that depth, else
        the full tree's scaled by depth) plus what a tree step's own work (sampling every node,
        the acceptance rule, keeping the path) adds over a plain step's, the profile times neither."""
        full_depth = min(self.depth, self.max_nodes - 1)
        full = self.draft_s[full_depth]
        seen = self.plain_extra_s is not None and self.tree_extra_s is not None
        tree_work = max(self.tree_extra_s - self.plain_extra_s, 0.0) if seen else 0.0
        out = [0.0]
        for n in range(2, self.max_nodes + 1):
            d = min(n - 1, full_depth)
            # Never above the full tree's (refreshed by every probe): a cold first draft at
            # some depth must not keep that depth from being drafted again.
            out.append((min(self.draft_s[d], full) if self.draft_s[d] and full else full * d / full_depth) + tree_work)
        return out

    def note_pass(self, batch: int, nodes: int, seconds: float) -> None:
        """EMA of a step's seconds after drafting beyond its profiled forward, apart for plain
        steps (nodes = 1) and tree steps."""
        extra = seconds - self.profile.latency(batch, nodes)
        old = self.plain_extra_s if nodes == 1 else self.tree_extra_s
        new = extra if old is None else COST_MODEL_MOMENTUM * old + (1 - COST_MODEL_MOMENTUM) * extra
        if nodes == 1:
            self.plain_extra_s = new
        else:
            self.tree_extra_s = new

    def note_drafted(self, cands, drafts: int, seconds: float) -> None:
        """Update the EMAs of drafting time and of expected tokens per row (one step's drafts say
        little about the next ones: confidence varies per token)."""
        m = COST_MODEL_MOMENTUM
        depth = min(drafts, self.depth)
        old = self.draft_s[depth]
        # The first, or after a cold start: averaging would keep it high for long.
        self.draft_s[depth] = seconds if not old or seconds < old / 2 else m * old + (1 - m) * seconds
        # Kept on the host (this step reads its drafts anyway), so planning a step never syncs.
        expected = cands.expected_tokens(drafts + 1).mean(dim=0).cpu()
        if self.expected_per_row is None:
            self.expected_per_row, self.typical_per_row = expected, expected
        else:
            self.expected_per_row = blend(self.expected_per_row, expected, m)
            self.typical_per_row = blend(self.typical_per_row, expected, TYPICAL_MOMENTUM)
        self.steps_since_full_draft = 0 if drafts == self.max_nodes - 1 else self.steps_since_full_draft + 1

    def note_would_be(self, realised: torch.Tensor) -> None:
        """Blend in the mean tokens per row that would-be trees of 1..K nodes realised while plain
        (`verification.would_be`): outcomes, where drafts give expectations, of the same quantity."""
        if self.expected_per_row is None:  # larger trees: as the largest realised, until drafted
            flat = torch.cat((realised, realised[-1:].expand(max(self.max_nodes - len(realised), 0))))
            self.expected_per_row, self.typical_per_row = flat, flat
            return
        self.expected_per_row = blend(self.expected_per_row, realised, COST_MODEL_MOMENTUM)
        self.typical_per_row = blend(self.typical_per_row, realised, TYPICAL_MOMENTUM)


def blend(average: torch.Tensor, observed: torch.Tensor, momentum: float) -> torch.Tensor:
    """EMA step of expected tokens per tree size where `observed` covers only the smaller
    trees (a step drafted for its planned tree): the larger trees' estimates move by as much
    as the largest observed one, so a plan can grow as confidence rises without a probe."""
    covered = min(len(observed), len(average))
    head = momentum * average[:covered] + (1 - momentum) * observed[:covered]
    return torch.cat((head, average[covered:] + (head[-1] - average[covered - 1])))
