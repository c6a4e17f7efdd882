"""Reflex: a gradient-free, per-response correction of the draft heads (docs/algorithm.md, section 5).

Each verify pass gives, at every node of the accepted path that the heads drafted children
for, both the heads' proposal q there (kept as a sketch: top-m log-probs and ids) and the
policy's distribution p there: a matured record, for free. Its error, mapped into hidden
space through the shared LM head's rows, is the direction that moves head logits toward p:

    r_dist = sum_v (p(v) - q(v)) W_lm[v]                      (over p's top and q's top tokens)
    r_cov  = sum_{v in top(p), not drafted} p(v) W_lm[v]      (target mass the tree missed)

Records are weighted by a TV gate `clip((TV - tv_floor) / tv_span, 0, 1) * horizon_decay^(k-1)`.
A per-response fast state s follows the normalised feedback with a half-life in tokens; it is
added to every head's state before the LM head, at most ~1% of that state's RMS times
`scale`, and only while a reliability score (a running cosine between s, the correction
the state predicts, and the feedback that then materialises) is above a threshold. A guard
switches injection off after rollouts whose accepted length falls below its baseline.

Reflex changes only which tokens are drafted: the tree stays a function of the response's
past, and verification samples every token from the policy, so exactness holds. Nothing
persists beyond a response and no parameter changes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specroll.config_checks import check_choice, check_int, check_number, check_positive, check_probability

from ..drafting.heads import draft_policy_top
from .maturation import MaturedProposals

REFLEX_MODES = ("paper", "code")


@dataclass
class ReflexConfig:
    """Reflex knobs (mirrored by `rollout.speculation.reflex` in conf/rollout/speculation.yaml)."""

    # paper: distribution + coverage feedback, injected only while reliable; code: the first
    # author's public code, one distribution term and no reliability score.
    mode: str = "paper"
    scale: float = 1.0  # multiplies the injected correction (1: at most ~1% of the head state's RMS)
    half_life_tokens: float = 48.0  # the fast state halves over this many emitted tokens
    eta: float = 0.5  # step size of the fast state toward the normalised feedback
    norm_momentum: float = 0.99  # EMA of the feedback's mean square, for its normalisation
    feedback_clip: float = 3.0  # RMS cap of the normalised feedback
    reset_rms: float = 2.5  # normalised feedback above this RMS (a blow-up) resets the state to zero
    state_clip: float = 2.0  # RMS cap of the fast state
    tv_floor: float = 0.05  # records with TV(p, q) below this carry no feedback
    tv_span: float = 0.15  # TV above tv_floor + tv_span carries full weight
    horizon_decay: float = 0.85  # record weight per head depth k: horizon_decay^(k-1)
    coverage_weight: float = 1.0  # paper mode: weight of the coverage term next to the distribution term
    sketch_size: int = 32  # m: top head log-probs kept per proposal (and top target tokens per record)
    evidence_scale: float = 16.0  # injection ramps in as 1 - exp(-E / evidence_scale), E = gate mass seen
    reliability_momentum: float = 0.95  # EMA of the cosine between predicted correction and new feedback
    reliability_threshold: float = 0.2  # paper mode: inject only above this reliability
    guard_baseline_rollouts: int = 20  # generate calls whose accepted length sets the guard's baseline
    guard_ratio: float = 0.95  # a call below this fraction of the baseline is bad
    guard_bad_in_a_row: int = 2  # this many bad calls in a row switch injection off ...
    guard_off_rollouts: int = 50  # ... for this many calls

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, REFLEX_MODES)
        check_number("scale", self.scale, 0)
        check_positive("half_life_tokens", self.half_life_tokens)
        check_positive("eta", self.eta)
        for name in ("norm_momentum", "reliability_momentum"):
            check_probability(name, getattr(self, name), high_open=True)
        for name in ("feedback_clip", "reset_rms", "state_clip", "tv_span", "evidence_scale"):
            check_positive(name, getattr(self, name))
        check_probability("tv_floor", self.tv_floor, high_open=True)
        check_probability("horizon_decay", self.horizon_decay, low_open=True)
        check_number("coverage_weight", self.coverage_weight, 0)
        check_int("sketch_size", self.sketch_size, 1)
        check_number("reliability_threshold", self.reliability_threshold, -1, 1)
        for name in ("guard_baseline_rollouts", "guard_bad_in_a_row", "guard_off_rollouts"):
            check_int(name, getattr(self, name), 1)
        check_probability("guard_ratio", self.guard_ratio, low_open=True)


@dataclass
class Feedback:
    """What the matured records of one verify pass say, per row."""

    direction: torch.Tensor  # [B, D] gate-weighted mean of the records' hidden-space errors
    gate_mass: torch.Tensor  # [B] sum of record gates (0: no feedback this pass)
    records: torch.Tensor  # [B] matured records
    tv_sum: torch.Tensor  # [B] sum of the records' TV(p, q)


def rms(x: torch.Tensor) -> torch.Tensor:
    """Root mean square over the last dimension."""
    return x.pow(2).mean(dim=-1).sqrt()


def clip_rms(x: torch.Tensor, limit: float) -> torch.Tensor:
    """x scaled down where its RMS (last dimension) exceeds `limit`."""
    return x * (limit / rms(x).clamp(min=limit))[..., None]


def record_errors(p_logp: torch.Tensor, p_ids: torch.Tensor, p_at_sketch: torch.Tensor, head_logp: torch.Tensor,
                  head_ids: torch.Tensor, drafted: torch.Tensor, lm_head: torch.Tensor, coverage_weight: float):
    """Hidden-space error and TV of R matured records.

    p_logp, p_ids [R, k]: the policy's top tokens at the node; p_at_sketch [R, m]: its log-probs
    at the heads' sketch head_logp, head_ids [R, m] (`heads.draft_policy_top`); drafted [R, C]:
    ids of the children the tree held (-1: none); lm_head [V, D].
    Returns (error [R, D] = r_dist + coverage_weight * r_cov, tv [R]). Both sums run over the
    union of p's top tokens and q's sketch; TV counts the mass outside it as one bucket.
    """
    ids = torch.cat((p_ids, head_ids), dim=1)  # [R, k + m]
    q_of_p = ((p_ids[:, :, None] == head_ids[:, None, :]) * head_logp.exp()[:, None, :]).sum(-1)  # 0 outside the sketch
    in_p = (head_ids[:, :, None] == p_ids[:, None, :]).any(-1)  # sketch tokens already counted on p's side
    p = torch.cat((p_logp.exp(), torch.where(in_p, 0.0, p_at_sketch.exp())), dim=1)
    q = torch.cat((q_of_p, torch.where(in_p, 0.0, head_logp.exp())), dim=1)
    rows = lm_head[ids].float()  # [R, k + m, D]
    coef = p - q
    if coverage_weight:
        missed = ~(p_ids[:, :, None] == drafted[:, None, :]).any(-1)
        coef[:, : p_ids.shape[1]] += coverage_weight * p[:, : p_ids.shape[1]] * missed
    error = torch.einsum("rn,rnd->rd", coef, rows)
    tv = 0.5 * ((p - q).abs().sum(1) + ((1 - p.sum(1)) - (1 - q.sum(1))).abs())
    return error, tv


def record_gate(tv: torch.Tensor, depth: torch.Tensor, cfg: ReflexConfig) -> torch.Tensor:
    """[R] weight of each record: the TV gate times the horizon decay of its head depth k >= 1."""
    return ((tv - cfg.tv_floor) / cfg.tv_span).clamp(0, 1) * cfg.horizon_decay ** (depth.float() - 1)


class FastState:
    """Per-response Reflex state, kept in the engine's row order (see `DecodeState.keep`)."""

    def __init__(self, rows: int, hidden: int, device) -> None:
        self.state = torch.zeros(rows, hidden, device=device)  # s
        self.norm = torch.zeros(rows, device=device)  # EMA of mean(f^2); 0: none yet
        self.reliability = torch.zeros(rows, device=device)
        self.evidence = torch.zeros(rows, device=device)  # E: gate mass accumulated
        self.resets = 0

    @staticmethod
    def no_feedback(rows: int, hidden: int, device) -> Feedback:
        zeros = torch.zeros(rows, device=device)
        return Feedback(torch.zeros(rows, hidden, device=device), zeros, zeros, zeros)

    def keep(self, rows: torch.Tensor) -> None:
        self.state, self.norm = self.state[rows], self.norm[rows]
        self.reliability, self.evidence = self.reliability[rows], self.evidence[rows]

    def update(self, feedback: Feedback, emitted: torch.Tensor, cfg: ReflexConfig) -> None:
        """One verify pass: decay by the tokens it emitted, then step toward the new feedback."""
        has = feedback.gate_mass > 0
        f = feedback.direction
        square = f.pow(2).mean(dim=1)
        m = cfg.norm_momentum
        self.norm = torch.where(has, torch.where(self.norm > 0, m * self.norm + (1 - m) * square, square), self.norm)
        f_hat = f / self.norm.clamp(min=1e-30).sqrt()[:, None]
        # How well the state (the correction it predicts) pointed at the error that then materialised.
        cosine = torch.nn.functional.cosine_similarity(self.state, f_hat, dim=1)
        predicted = has & (rms(self.state) > 0)
        r = cfg.reliability_momentum
        self.reliability = torch.where(predicted, r * self.reliability + (1 - r) * cosine, self.reliability)
        blown = has & ~(rms(f_hat) <= cfg.reset_rms)  # also catches non-finite feedback
        self.resets += int(blown.sum())
        decay = 0.5 ** (emitted.float() / cfg.half_life_tokens)
        step = torch.where((has & ~blown)[:, None], clip_rms(torch.nan_to_num(f_hat), cfg.feedback_clip), 0.0)
        self.state = clip_rms(decay[:, None] * self.state + (1 - decay)[:, None] * cfg.eta * step, cfg.state_clip)
        self.state = torch.where(blown[:, None], 0.0, self.state)
        self.evidence += feedback.gate_mass

    def active(self, cfg: ReflexConfig) -> torch.Tensor:
        """[B] rows whose correction is injected (paper mode: only while reliable)."""
        on = rms(self.state) > 0
        if cfg.mode == "paper":
            on &= self.reliability > cfg.reliability_threshold
        return on

    def correction(self, depth: int, head_states: torch.Tensor, cfg: ReflexConfig) -> torch.Tensor:
        """What to add to head `depth`'s (1-based) states [B, F, D] before the LM head."""
        size = rms(self.state)  # [B]
        ramp = 1 - torch.exp(-self.evidence / cfg.evidence_scale)
        factor = cfg.scale * ramp * size / (size + 0.25) * (0.01 / math.sqrt(depth)) * self.active(cfg)
        direction = self.state / size.clamp(min=1e-12)[:, None]  # s / rms(s)
        return (factor[:, None] * rms(head_states))[..., None] * direction[:, None, :]


class SafetyGuard:
    """Switches injection off after rollouts (generate calls) whose accepted length falls
    below a baseline: `bad_in_a_row` calls under `ratio` x baseline turn it off for `off` calls."""

    def __init__(self, cfg: ReflexConfig) -> None:
        self.cfg = cfg
        self.baseline_values: list[float] = []
        self.bad_in_a_row = 0
        self.off_for = 0
        self.trips = 0

    @property
    def allows(self) -> bool:
        return self.off_for == 0

    @property
    def baseline(self) -> float | None:
        done = len(self.baseline_values) >= self.cfg.guard_baseline_rollouts
        return sum(self.baseline_values) / len(self.baseline_values) if done else None

    def end_rollout(self, accepted_length: float) -> None:
        """After a generate call: its mean tokens per verify pass."""
        if self.off_for:
            self.off_for -= 1
            return
        if self.baseline is None:
            self.baseline_values.append(accepted_length)
            return
        self.bad_in_a_row = self.bad_in_a_row + 1 if accepted_length < self.cfg.guard_ratio * self.baseline else 0
        if self.bad_in_a_row >= self.cfg.guard_bad_in_a_row:
            self.off_for, self.bad_in_a_row = self.cfg.guard_off_rollouts, 0
            self.trips += 1


def matured_feedback(matured: MaturedProposals, target_logp: torch.Tensor, lm_head: torch.Tensor,
                     cfg: ReflexConfig, draft_vocab: torch.Tensor | None = None) -> Feedback:
    """The records that matured in one verify pass (`target_logp` [B, 1+M, V] from it), reduced per
    row. Heads with a draft vocabulary are judged against the target restricted to it."""
    batch, device = target_logp.shape[0], target_logp.device
    direction = torch.zeros(batch, lm_head.shape[1], device=device)
    gate_mass, records, tv_sum = (torch.zeros(batch, device=device) for _ in range(3))
    if len(matured.row):
        coverage = cfg.coverage_weight if cfg.mode == "paper" else 0.0
        r = matured.row
        p_logp, p_ids, log_normaliser = draft_policy_top(target_logp, r, matured.node, draft_vocab, cfg.sketch_size)
        p_at_sketch = (target_logp[r[:, None], matured.node[:, None], matured.head_ids].float() - log_normaliser)
        error, tv = record_errors(p_logp, p_ids, p_at_sketch.nan_to_num(nan=-math.inf), matured.head_logp,
                                  matured.head_ids, matured.children, lm_head, coverage)
        gate = record_gate(tv, matured.depth + 1, cfg)
        direction.index_add_(0, r, gate[:, None] * error)
        gate_mass.index_add_(0, r, gate)
        records.index_add_(0, r, torch.ones_like(gate))
        tv_sum.index_add_(0, r, tv)
    direction /= gate_mass.clamp(min=1e-12)[:, None]
    return Feedback(direction, gate_mass, records, tv_sum)
