"""Configuration of speculative rollouts (mirrored by conf/rollout/speculation.yaml)."""
from __future__ import annotations

from dataclasses import dataclass, field

from specroll.config_checks import check_bool, check_choice, check_int, check_number, check_probability, require

from .adaptation.consolidation import ConsolidationConfig
from .adaptation.drift_detector import DriftConfig
from .adaptation.head_records import RECORD_NODES
from .adaptation.reflex import ReflexConfig
from .budgets.policies import BUDGET_POLICIES
from .drafting.heads import HEAD_TYPES

# How the drafter follows the moving policy: static = frozen heads; reflex = the fast,
# per-response correction (speculation/adaptation/reflex.py); slow = drift-triggered head-only updates in the
# head-consolidation actor; both = reflex and slow; every_step = reflex and a head update
# after every training step (FastGRPO's schedule, to show what the trigger saves).
ADAPTATION_MODES = ("static", "reflex", "slow", "both", "every_step")


@dataclass
class SpeculationConfig:
    num_heads: int = 4  # H horizon heads; head d drafts depth d + 1, so H is also the trees' depth by default
    # Deepest a tree drafts, the root not counted; None = the heads' depth. At most the heads' depth
    # (refused above it, see `tree_depth`): nothing drafts past the last head yet.
    max_depth: int | None = None
    head_type: str = "path"  # "path" (Hydra-style, reads the tree path) or "medusa"
    # Trained heads file; "shipped" = the heads for this model: DIR.heads.safetensors beside a model
    # directory, else SpecRoll's shipped ones (untrained if none); None = freshly initialised heads.
    heads_path: str | None = "shipped"
    # Node budget policy: auto (concurrency on GPUs, cost_model on CPUs) | fixed | concurrency | cost_model.
    budget: str = "auto"
    fixed_nodes: int = 8  # nodes per response (root included) for budget=fixed, and of would-be trees
    # Where the budget decodes plain, draft a would-be tree (fixed_nodes nodes) every this many plain
    # steps for the rows whose last one is scored, and score it against the tokens plain sampling
    # emits (speculation/verification/would_be.py); a probe's drafts are scored for free. 0 = off.
    would_be_every: int = 32
    min_nodes: int = 1  # N_min; 1 = plain decoding when speculation does not fit
    max_nodes: int = 16  # N_max nodes per response, root included
    # cost_model and the tree gate (concurrency with sync-free trees, speculation/budgets/tree_gate.py): a tree
    # must beat plain decoding's estimated rate by this fraction. Near break-even the estimates'
    # noise decides, and a wrong tree costs more than a right one gains.
    min_gain: float = 0.05
    # C_hw override; None = from the cached hardware profile, which with sync-free trees also
    # gates them: plain steps where a tree's measured tokens do not pay for its profiled cost.
    capacity: int | None = None
    # Tree steps sized on the host (fixed and concurrency budgets, static drafting) run without host
    # reads, finished rows riding along until the engine's next read. None: on GPUs, where a read
    # stalls the queue of launched work; on a CPU a read costs nothing, the riders do.
    sync_free_trees: bool | None = None
    max_children: int = 8  # children drafted per node before the global best-N cut
    max_frontier: int = 4  # nodes per depth that get children (each costs an LM-head product)
    calibration_momentum: float = 0.95  # EMA of per-depth acceptance calibration
    # Also draft what followed the latest earlier occurrence of a row's last tokens (see speculation/drafting/lookup.py).
    context_lookup: bool = True
    lookup_ngram: int = 3  # longest suffix matched by context lookup (and by sibling and history lookup)
    # Draft the horizon heads' paths; False: only the lookups' chains (the root still verifies).
    head_drafts: bool = True
    # Under the coupled Gumbel sampler (rollout.sampler: gumbel), every source drafts the token its
    # node's coming draw will pick, not the likeliest (speculation/drafting/reading.py); False: blind
    # drafts, as under inverse-CDF sampling, where the noise means nothing. Never changes a response.
    read_draws: bool = True
    # Also draft what followed a row's last tokens in the text its group siblings generated so far,
    # and in earlier responses to its prompt (speculation/drafting/suffix_drafts.py). Both read the
    # rows' tokens on the host every tree step, so trees with either on are never sync-free.
    sibling_lookup: bool = False
    history_lookup: bool = False
    history_tokens_per_prompt: int = 4096  # history lookup: tokens kept per prompt, oldest responses evicted first
    history_tokens: int = 262144  # history lookup: tokens kept in all by one rollout actor, oldest evicted first
    profile_cache_len: int = 256  # cache length the hardware profile is measured at
    adaptation: str = "static"  # how drafts follow the moving policy: static | reflex | slow | both | every_step
    reflex: ReflexConfig = field(default_factory=ReflexConfig)  # Reflex knobs (adaptation reflex, both, every_step)
    # Enough records that an update after a format drift has something to learn from (docs/history/2026-12-02.md).
    records_per_rollout: int = 4096  # slow path: matured records a generate call sends, a uniform sample
    record_nodes: str = "path"  # slow path: records from the accepted path (path) or every verified node (tree)
    drift: DriftConfig = field(default_factory=DriftConfig)  # slow path: when a head-only update is triggered
    consolidation: ConsolidationConfig = field(default_factory=ConsolidationConfig)  # slow path: the update itself

    def __post_init__(self) -> None:
        check_int("num_heads", self.num_heads, 1)
        if self.max_depth is not None:
            check_int("max_depth", self.max_depth, 1)
        self.tree_depth(self.num_heads)  # the heads this config makes
        check_choice("head_type", self.head_type, HEAD_TYPES)
        check_choice("budget", self.budget, BUDGET_POLICIES)
        check_int("min_nodes", self.min_nodes, 1)
        check_int("max_nodes", self.max_nodes, self.min_nodes, why="min_nodes is the least a step drafts")
        check_int("fixed_nodes", self.fixed_nodes, self.min_nodes, self.max_nodes)
        check_int("would_be_every", self.would_be_every, 0)
        if self.capacity is not None:
            check_int("capacity", self.capacity, 1)
        check_int("max_frontier", self.max_frontier, 1)
        check_int("max_children", self.max_children, 1)
        check_number("min_gain", self.min_gain, 0)
        check_int("lookup_ngram", self.lookup_ngram, 1)
        require(self.head_drafts or self.context_lookup or self.sibling_lookup or self.history_lookup, "head_drafts",
                self.head_drafts, "true when every lookup is off", why="nothing would be drafted")
        check_bool("read_draws", self.read_draws)
        check_int("history_tokens_per_prompt", self.history_tokens_per_prompt, 1)
        check_int("history_tokens", self.history_tokens, self.history_tokens_per_prompt,
                  why="history_tokens_per_prompt is what one prompt keeps")
        check_choice("adaptation", self.adaptation, ADAPTATION_MODES)
        check_int("records_per_rollout", self.records_per_rollout, 1)
        check_choice("record_nodes", self.record_nodes, RECORD_NODES)
        check_probability("calibration_momentum", self.calibration_momentum, high_open=True)

    def tree_depth(self, heads_depth: int) -> int:
        """How deep trees draft with heads of `heads_depth` (`HorizonHeads.num_heads`): `max_depth`,
        or the heads' depth where it is None. The one place tree depth is decided: every structure
        sized by depth asks the decoder's `depth`, which asks this."""
        if self.max_depth is None:
            return heads_depth
        require(self.max_depth <= heads_depth, "max_depth", self.max_depth, f"null or <= the heads' depth ({heads_depth})",
                why="no draft source reaches past the last head yet")
        return self.max_depth

    @property
    def scores_would_be(self) -> bool:
        """Whether plain steps score would-be trees (only budgets that may decode plain do)."""
        return self.would_be_every > 0 and self.fixed_nodes > 1 and self.budget != "fixed"

    @property
    def drafts_on_host(self) -> bool:
        """Whether drafting reads the rows' tokens on the host or skips the heads (no sync-free trees)."""
        return self.sibling_lookup or self.history_lookup or not self.head_drafts

    @property
    def uses_reflex(self) -> bool:
        return self.adaptation in ("reflex", "both", "every_step")

    @property
    def uses_slow_path(self) -> bool:
        return self.adaptation in ("slow", "both", "every_step")
