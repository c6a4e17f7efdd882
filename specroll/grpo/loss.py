"""The GRPO policy loss: clipped surrogate with clip-higher, optional dual clip and KL penalty,
and the variants GSPO, CISPO, mismatch correction and entropy-selected tokens.

Per valid token, with the importance ratio ``ratio`` and the sequence's advantage ``A``:

    pg = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)    surrogate "clipped"
    pg = min(pg, -dual_clip * A)              if dual_clip and A < 0
    pg = -sg(min(ratio, cispo_weight_max)) * A * logp_new                  surrogate "cispo"
    pg = pg * [entropy in the top top_entropy_quantile]                    entropy-selected tokens
    pg = pg * w                               w: mismatch_weights (rollout-learner correction)
    loss_token = pg + kl_coef * kl(logp_new, logp_ref)

then reduced to a scalar by ``aggregate``. ``ratio`` is ``exp(logp_new - logp_old)`` per token
("token") or ``exp(mean_t(logp_new - logp_old))`` per sequence ("sequence", GSPO). GSPO-token
is not a separate level: with one advantage per response its loss and gradient are GSPO's.
The order of the factors is TRL's ``GRPOTrainer._compute_loss``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from specroll.config_checks import check_bool, check_choice, check_number, check_positive, check_probability, require
from specroll.grpo.aggregation import AGGREGATION_MODES, Aggregation, aggregate
from specroll.grpo.entropy import high_entropy_mask
from specroll.grpo.kl import KL_ESTIMATORS, KLEstimator, kl_estimate
from specroll.grpo.mismatch import MISMATCH_MODES, MismatchMode, mismatch_weights

ImportanceLevel = Literal["token", "sequence"]
IMPORTANCE_LEVELS: tuple[str, ...] = ("token", "sequence")
Surrogate = Literal["clipped", "cispo"]
SURROGATES: tuple[str, ...] = ("clipped", "cispo")


@dataclass
class PolicyLossConfig:
    """Hyper-parameters of ``policy_loss``."""

    clip_low: float = 0.2
    """Ratio lower bound is ``1 - clip_low``; in ``[0, 1)``."""

    clip_high: float = 0.28
    """Ratio upper bound is ``1 + clip_high``; larger than ``clip_low`` ("clip-higher", DAPO)
    so unlikely tokens can gain probability faster, which delays entropy collapse."""

    dual_clip: float | None = None
    """If set (> 1, e.g. 3.0), caps the per-token loss of negative-advantage tokens at
    ``-dual_clip * A`` so a huge ratio cannot dominate the batch (dual-clip PPO). None: off."""

    log_ratio_clamp: float = 20.0
    """``logp_new - logp_old`` is clamped to ``[-log_ratio_clamp, log_ratio_clamp]`` before
    ``exp``, so a stale or mismatched log-prob cannot overflow the ratio to inf."""

    kl_coef: float = 0.0
    """Weight ``beta`` of the per-token KL penalty to the reference policy; 0 disables it
    (GRPO without a reference model, the default)."""

    kl_estimator: KLEstimator = "k3"
    """KL estimator used for the penalty: ``"k1"``, ``"k2"`` or ``"k3"`` (see ``grpo.kl``)."""

    aggregation: Aggregation = "token-mean"
    """How per-token losses become a scalar; one of ``AGGREGATION_MODES``."""

    mask_truncated: bool = False
    """If true, responses that hit the length cap contribute no loss: their missing ending
    makes their reward say little about the tokens they contain (DAPO overlong filtering)."""

    importance_sampling_level: ImportanceLevel = "token"
    """Where the ratio lives: "token" (PPO/GRPO) or "sequence" (GSPO: one ratio per response,
    the geometric mean of its token ratios, clipped as a whole)."""

    surrogate: Surrogate = "clipped"
    """"clipped": PPO's clipped surrogate. "cispo": CISPO (MiniMax-M1), ``-sg(min(ratio,
    cispo_weight_max)) * A * logp_new``: the weight is capped instead of the token dropped, so
    every token keeps its gradient. Needs aggregation "token-mean" and no dual_clip."""

    cispo_weight_max: float = 5.0
    """CISPO's cap on the importance weight (TRL ``epsilon_high`` with ``loss_type="cispo"``,
    ScaleRL's epsilon_max); > 1. Unused by the clipped surrogate."""

    mismatch_correction: MismatchMode | None = None
    """Rollout-learner mismatch correction: "token_truncate", "token_mask",
    "sequence_truncate" or "sequence_mask" (see ``grpo.mismatch``); None: off. Needs the
    sampler's log-probs of the tokens besides the learner's own."""

    mismatch_weight_max: float | None = 3.0
    """Upper bound of the mismatch weight (TRL ``vllm_importance_sampling_clip_max``); None: none."""

    mismatch_weight_min: float | None = None
    """Lower bound of the mismatch weight (TRL ``vllm_importance_sampling_clip_min``); None: none."""

    top_entropy_quantile: float = 1.0
    """The policy gradient acts only on the tokens whose entropy is in this top quantile of the
    micro-batch's valid tokens, in [0, 1] (0.2 in "Beyond the 80/20 Rule"); 1 keeps all. The KL
    penalty still covers every token."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        check_probability("clip_low", self.clip_low, high_open=True)
        check_number("clip_high", self.clip_high, 0)
        if self.dual_clip is not None:
            check_number("dual_clip", self.dual_clip, 1, low_open=True)
        check_positive("log_ratio_clamp", self.log_ratio_clamp)
        check_number("kl_coef", self.kl_coef, 0)
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_choice("aggregation", self.aggregation, AGGREGATION_MODES)
        check_bool("mask_truncated", self.mask_truncated)
        self.validate_variants()

    def validate_variants(self) -> None:
        """GSPO, CISPO, the mismatch correction and entropy-selected tokens, and how they combine."""
        check_choice("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_LEVELS)
        check_choice("surrogate", self.surrogate, SURROGATES)
        check_number("cispo_weight_max", self.cispo_weight_max, 1, low_open=True)
        cispo = self.surrogate == "cispo"
        require(not cispo or self.aggregation == "token-mean", "aggregation", self.aggregation,
                "'token-mean' with surrogate 'cispo'", why="CISPO normalises by tokens, as in TRL")
        require(not cispo or self.dual_clip is None, "dual_clip", self.dual_clip, "null with surrogate 'cispo'",
                why="dual_clip caps the clipped surrogate; CISPO caps its weight with cispo_weight_max instead")
        if self.mismatch_correction is not None:
            check_choice("mismatch_correction", self.mismatch_correction, MISMATCH_MODES)
        for name in ("mismatch_weight_max", "mismatch_weight_min"):
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name), 0)
        low, high = self.mismatch_weight_min, self.mismatch_weight_max
        if low is not None and high is not None:
            check_number("mismatch_weight_min", low, 0, high, high_open=True)
        truncates = (self.mismatch_correction or "").endswith("truncate")
        require(not truncates or low is not None or high is not None, "mismatch_weight_max", high,
                f"a bound (or mismatch_weight_min one) with mismatch_correction {self.mismatch_correction!r}",
                why="an unbounded weight truncates nothing")
        check_probability("top_entropy_quantile", self.top_entropy_quantile)


def valid_token_mask(
    mask: Tensor, truncated: Tensor | None, mask_truncated: bool
) -> Tensor:
    """The ``[B, T]`` bool mask of tokens that carry loss: ``mask`` minus truncated responses
    when ``mask_truncated`` is set. Use it to compute a micro-batch's ``normalizer`` share."""
    valid = mask.bool()
    if not mask_truncated:
        return valid
    if truncated is None:
        raise ValueError("mask_truncated=True needs the per-response truncated flags")
    if truncated.shape != valid.shape[:1]:
        raise ValueError(f"truncated {tuple(truncated.shape)} must be [B={valid.shape[0]}]")
    return valid & ~truncated.bool()[:, None]


def importance_log_ratio(token_log_ratio: Tensor, valid: Tensor, level: ImportanceLevel) -> Tensor:
    """``[B, T]`` log importance ratio at ``level`` from the per-token ``logp_new - logp_old``:
    itself ("token"), or the mean over the sequence's valid tokens on each of them, so the
    sequence is clipped as a whole ("sequence", GSPO)."""
    if level == "token":
        return token_log_ratio
    counts = valid.sum(dim=-1, keepdim=True).clamp_min(1)
    masked = torch.where(valid, token_log_ratio, torch.zeros_like(token_log_ratio))
    return (masked.sum(dim=-1, keepdim=True) / counts).expand_as(token_log_ratio)


def _advantage_stats(advantages: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """Stats over the responses that carry loss; the population std gives 0, not NaN, for one."""
    used = advantages[valid.any(dim=-1)]
    if used.numel() == 0:
        used = advantages.new_zeros(1)
    return {
        "advantage_mean": used.mean(),
        "advantage_std": used.std(unbiased=False),
        "advantage_min": used.min(),
        "advantage_max": used.max(),
    }


def _check_inputs(logp_new: Tensor, logp_old: Tensor, advantages: Tensor, mask: Tensor, cfg: PolicyLossConfig,
                  logp_ref: Tensor | None, logp_sampler: Tensor | None, entropy: Tensor | None) -> None:
    """`policy_loss`'s arguments agree in shape, and each variant has the inputs it needs."""
    cfg.validate()
    if logp_new.dim() != 2 or logp_old.shape != logp_new.shape or mask.shape != logp_new.shape:
        raise ValueError(
            f"logp_new {tuple(logp_new.shape)}, logp_old {tuple(logp_old.shape)} and mask "
            f"{tuple(mask.shape)} must all be the same [B, T]"
        )
    if advantages.shape != logp_new.shape[:1]:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [B={logp_new.shape[0]}]")
    if logp_ref is not None and logp_ref.shape != logp_new.shape:
        raise ValueError(f"logp_ref {tuple(logp_ref.shape)} must match logp_new [B, T]")
    if cfg.kl_coef > 0 and logp_ref is None:
        raise ValueError("kl_coef > 0 needs logp_ref")
    if cfg.mismatch_correction is not None and logp_sampler is None:
        raise ValueError("mismatch_correction needs logp_sampler, the sampler's log-probs")
    if cfg.top_entropy_quantile < 1.0 and entropy is None:
        raise ValueError("top_entropy_quantile < 1 needs the per-token entropy")
    for name, extra in (("logp_sampler", logp_sampler), ("entropy", entropy)):
        if extra is not None and extra.shape != logp_new.shape:
            raise ValueError(f"{name} {tuple(extra.shape)} must match logp_new [B, T]")



def _surrogate(ratio: Tensor, adv: Tensor, new: Tensor, cfg: PolicyLossConfig) -> Tensor:
    """Per-token policy-gradient term: CISPO's stop-gradient clipped weight on log p, else the
    clipped PPO objective (with the dual clip's cap for negative advantages)."""
    if cfg.surrogate == "cispo":
        return -ratio.clamp(max=cfg.cispo_weight_max).detach() * adv * new
    clipped_ratio = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = -torch.minimum(ratio * adv, clipped_ratio * adv)
    if cfg.dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -cfg.dual_clip * adv), pg)
    return pg


def _ratio_stats(ratio: Tensor, adv: Tensor, old: Tensor, new: Tensor, valid: Tensor,
                 cfg: PolicyLossConfig) -> dict[str, Tensor]:
    """Clip fractions, the k3 KL to the old policy and the advantages' spread, over valid tokens."""
    def token_frac(flags: Tensor) -> Tensor:
        return aggregate(flags.to(ratio.dtype), valid, "token-mean")

    negative = adv < 0
    stats: dict[str, Tensor] = {}
    if cfg.surrogate == "cispo":
        stats["cispo_clip_frac"] = token_frac(ratio > cfg.cispo_weight_max)
    else:
        stats["clip_frac_low"] = token_frac((ratio < 1.0 - cfg.clip_low) & negative)
        stats["clip_frac_high"] = token_frac((ratio > 1.0 + cfg.clip_high) & (adv > 0))
    if cfg.dual_clip is not None:
        stats["dual_clip_frac"] = token_frac((ratio > cfg.dual_clip) & negative)
    stats["approx_kl"] = aggregate(kl_estimate(old, new, "k3", cfg.log_ratio_clamp), valid, "token-mean")
    stats.update(_advantage_stats(adv[:, 0], valid))
    return stats


def policy_loss(
    logp_new: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig,
    logp_ref: Tensor | None = None,
    truncated: Tensor | None = None,
    normalizer: float | None = None,
    logp_sampler: Tensor | None = None,
    entropy: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO loss for a (micro-)batch of responses; gradient flows into ``logp_new`` only.

    Args:
        logp_new: ``[B, T]`` log-probs of the sampled tokens under the policy being trained.
        logp_old: ``[B, T]`` log-probs under the policy that sampled them.
        advantages: ``[B]`` one advantage per response (``group_advantages``).
        mask: ``[B, T]`` valid response tokens. Values under a zero mask are ignored, even
            NaN/inf padding, and receive zero gradient.
        cfg: loss hyper-parameters; validated here.
        logp_ref: ``[B, T]`` log-probs under the reference policy; required if
            ``cfg.kl_coef > 0``.
        truncated: ``[B]`` bool, responses that hit the length cap; required if
            ``cfg.mask_truncated``.
        normalizer: the mini-batch-wide denominator (``aggregation_denominator`` of
            ``valid_token_mask`` summed over all micro-batches: valid tokens for "token-mean",
            non-empty sequences for the seq-mean modes), because DeepSpeed gradient
            accumulation sums micro-batch gradients; the micro-batch losses then add up to the
            full mini-batch loss. None: this batch is the whole mini-batch.
        logp_sampler: ``[B, T]`` log-probs under the distribution the tokens were sampled from;
            required if ``cfg.mismatch_correction`` (``logp_old`` is then the learner's own).
        entropy: ``[B, T]`` the policy's per-token entropy; required if
            ``cfg.top_entropy_quantile < 1``. The selection is made within this batch.

    Returns:
        ``(loss, metrics)``; metrics are detached 0-dim tensors. ``loss`` and ``pg_loss`` are
        this batch's share of the mini-batch value (they sum over micro-batches); the others
        are means over this batch's valid tokens:

        - ``clip_frac_low``: ratio < 1 - clip_low with A < 0 (clipped branch active);
        - ``clip_frac_high``: ratio > 1 + clip_high with A > 0;
        - ``dual_clip_frac`` (only with ``dual_clip``): A < 0 and the cap is active;
        - ``approx_kl``: k3 estimate of KL(pi_old || pi_new), ``ratio - 1 - log(ratio)``,
          unbiased because the tokens were sampled from pi_old;
        - ``kl_ref`` (only with ``logp_ref``): mean of the ``cfg.kl_estimator`` penalty term;
        - ``advantage_mean/std/min/max``: over responses with at least one valid token;
        - ``cispo_clip_frac`` (only with CISPO): the weight is capped at ``cispo_weight_max``;
        - ``is_weight_mean``, ``is_clipped_frac`` (only with ``mismatch_correction``): the
          mismatch weight, and the share of tokens whose weight was truncated or masked;
        - ``entropy_mask_frac`` (only with ``top_entropy_quantile < 1``): tokens selected.
    """
    _check_inputs(logp_new, logp_old, advantages, mask, cfg, logp_ref, logp_sampler, entropy)
    valid = valid_token_mask(mask, truncated, cfg.mask_truncated)
    dtype = torch.promote_types(logp_new.dtype, torch.float32)

    def prepared(logp: Tensor) -> Tensor:
        # Padding log-probs are often -inf; zeroing them before any arithmetic keeps both
        # the forward values and the backward pass free of inf - inf = NaN.
        return torch.where(valid, logp.to(dtype), torch.zeros((), dtype=dtype))

    new = prepared(logp_new)
    old = prepared(logp_old.detach())
    adv = advantages.detach().to(dtype)[:, None]

    token_log_ratio = (new - old).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    log_ratio = importance_log_ratio(token_log_ratio, valid, cfg.importance_sampling_level)
    ratio = torch.exp(log_ratio)
    metrics: dict[str, Tensor] = {}
    pg = _surrogate(ratio, adv, new, cfg)
    if cfg.top_entropy_quantile < 1.0:
        selected = high_entropy_mask(entropy, valid, cfg.top_entropy_quantile)
        pg = pg * selected
        metrics["entropy_mask_frac"] = aggregate(selected.to(dtype), valid, "token-mean")
    if cfg.mismatch_correction is not None:
        weights, outside = mismatch_weights(
            old, prepared(logp_sampler), valid, cfg.mismatch_correction,
            cfg.mismatch_weight_min, cfg.mismatch_weight_max,
        )
        pg = pg * weights
        metrics["is_weight_mean"] = aggregate(weights, valid, "token-mean")
        metrics["is_clipped_frac"] = aggregate(outside.to(dtype), valid, "token-mean")
    per_token = pg

    if logp_ref is not None:
        kl = kl_estimate(
            new, prepared(logp_ref.detach()), cfg.kl_estimator, cfg.log_ratio_clamp
        )
        if cfg.kl_coef > 0:
            per_token = pg + cfg.kl_coef * kl
        metrics["kl_ref"] = aggregate(kl.detach(), valid, "token-mean")

    loss = aggregate(per_token, valid, cfg.aggregation, normalizer)

    with torch.no_grad():
        metrics["loss"] = loss.detach()
        metrics["pg_loss"] = aggregate(pg, valid, cfg.aggregation, normalizer)
        metrics.update(_ratio_stats(ratio, adv, old, new, valid, cfg))
    return loss, metrics
