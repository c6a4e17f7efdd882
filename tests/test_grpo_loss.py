"""The GRPO policy loss on a hand-worked 2x3 batch, plus micro-batching and gradient flow.

Hand-worked batch (default clip_low=0.2, clip_high=0.28, so the ratio range is [0.8, 1.28]);
every old probability is 0.1 and new = 0.1 * ratio. Per-token loss -min(r*A, clip(r)*A):

    seq 0, A = +1: r = 1.1 -> -1.1  (unclipped)
                   r = 1.5 -> -1.28 (high-clipped: ratio > 1.28 with A > 0)
                   r = 0.5 -> -0.5  (below range, but with A > 0 the unclipped branch is smaller)
    seq 1, A = -1: r = 0.9 -> 0.9   (unclipped)
                   r = 0.5 -> 0.8   (low-clipped: ratio < 0.8 with A < 0)
                   r = 4.0 -> 4.0   (above range, with A < 0 the unclipped branch wins;
                                     dual clip c = 3 caps it at -c * A = 3.0)

Gradient of an unclipped token w.r.t. logp_new is -A * r (d r / d logp = r); clipped or capped
tokens get 0.
"""

import math

import pytest
import torch

from specroll.grpo import (
    PolicyLossConfig,
    aggregation_denominator,
    high_entropy_mask,
    policy_loss,
    soft_overlong_penalty,
    valid_token_mask,
)

RATIOS = torch.tensor([[1.1, 1.5, 0.5], [0.9, 0.5, 4.0]], dtype=torch.float64)
ADVANTAGES = torch.tensor([1.0, -1.0], dtype=torch.float64)
FULL_MASK = torch.ones(2, 3, dtype=torch.bool)


def _logps() -> tuple[torch.Tensor, torch.Tensor]:
    logp_old = torch.full((2, 3), math.log(0.1), dtype=torch.float64)
    logp_new = (logp_old + RATIOS.log()).requires_grad_()
    return logp_new, logp_old


def test_unclipped_low_and_high_clipped_tokens():
    logp_new, logp_old = _logps()
    loss, metrics = policy_loss(logp_new, logp_old, ADVANTAGES, FULL_MASK, PolicyLossConfig())
    # (-1.1 - 1.28 - 0.5 + 0.9 + 0.8 + 4.0) / 6 = 2.82 / 6 = 0.47
    torch.testing.assert_close(loss, torch.tensor(0.47, dtype=torch.float64))
    loss.backward()
    expected_grad = torch.tensor([[-1.1, 0.0, -0.5], [0.9, 0.0, 4.0]], dtype=torch.float64) / 6
    torch.testing.assert_close(logp_new.grad, expected_grad)
    assert metrics["clip_frac_low"].item() == pytest.approx(1 / 6)
    assert metrics["clip_frac_high"].item() == pytest.approx(1 / 6)
    assert metrics["pg_loss"].item() == pytest.approx(0.47)
    assert metrics["loss"].item() == pytest.approx(0.47)
    # approx_kl = mean of r - 1 - ln r: 0.0046898 + 0.0945349 + 0.1931472 + 0.0053605
    # + 0.1931472 + 1.6137056 = 2.1045852, / 6 = 0.3507642
    assert metrics["approx_kl"].item() == pytest.approx(0.3507642, abs=1e-7)
    assert metrics["advantage_mean"].item() == 0.0
    assert metrics["advantage_std"].item() == 1.0
    assert (metrics["advantage_min"].item(), metrics["advantage_max"].item()) == (-1.0, 1.0)
    assert "kl_ref" not in metrics and "dual_clip_frac" not in metrics
    for value in metrics.values():
        assert value.dim() == 0 and not value.requires_grad


def test_dual_clip_caps_negative_advantage_tokens():
    logp_new, logp_old = _logps()
    cfg = PolicyLossConfig(dual_clip=3.0)
    loss, metrics = policy_loss(logp_new, logp_old, ADVANTAGES, FULL_MASK, cfg)
    # The r = 4.0, A = -1 token drops from 4.0 to 3.0: (2.82 - 1.0) / 6 = 0.303333...
    torch.testing.assert_close(loss, torch.tensor(1.82 / 6, dtype=torch.float64))
    loss.backward()
    expected_grad = torch.tensor([[-1.1, 0.0, -0.5], [0.9, 0.0, 0.0]], dtype=torch.float64) / 6
    torch.testing.assert_close(logp_new.grad, expected_grad)
    assert metrics["dual_clip_frac"].item() == pytest.approx(1 / 6)


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        # Valid per-token losses: seq 0 = [-1.1, -1.28, -0.5] (sum -2.88), seq 1 = [0.9, 0.8]
        # (sum 1.7); the r = 4.0 token is padding.
        ("token-mean", (-2.88 + 1.7) / 5),  # -0.236
        ("seq-mean-token-mean", (-2.88 / 3 + 1.7 / 2) / 2),  # -0.055
        ("seq-mean-token-sum", (-2.88 + 1.7) / 2),  # -0.59
    ],
)
def test_aggregation_modes_on_ragged_mask_ignore_inf_padding(aggregation, expected):
    logp_new, logp_old = _logps()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    padded_new = torch.where(mask.bool(), logp_new, torch.tensor(float("-inf")))
    padded_old = torch.where(mask.bool(), logp_old, torch.tensor(float("-inf")))
    cfg = PolicyLossConfig(aggregation=aggregation)
    loss, _ = policy_loss(padded_new, padded_old, ADVANTAGES, mask, cfg)
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    loss.backward()
    assert torch.isfinite(logp_new.grad).all()
    assert logp_new.grad[1, 2] == 0.0


def test_truncated_responses_masked_only_when_enabled():
    logp_new, logp_old = _logps()
    truncated = torch.tensor([False, True])
    cfg = PolicyLossConfig(mask_truncated=True)
    loss, _ = policy_loss(logp_new, logp_old, ADVANTAGES, FULL_MASK, cfg, truncated=truncated)
    # Only seq 0 counts: -2.88 / 3 = -0.96.
    torch.testing.assert_close(loss, torch.tensor(-0.96, dtype=torch.float64))
    loss.backward()
    assert torch.equal(logp_new.grad[1], torch.zeros(3, dtype=torch.float64))

    kept, _ = policy_loss(
        logp_new, logp_old, ADVANTAGES, FULL_MASK, PolicyLossConfig(), truncated=truncated
    )
    torch.testing.assert_close(kept, torch.tensor(0.47, dtype=torch.float64))

    with pytest.raises(ValueError, match="truncated"):
        policy_loss(logp_new, logp_old, ADVANTAGES, FULL_MASK, cfg)


def _kl_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # Ratio 1 and A = 0 make the surrogate exactly 0, isolating the KL term.
    logp_new = torch.full((1, 2), math.log(0.5), dtype=torch.float64, requires_grad=True)
    logp_old = torch.full((1, 2), math.log(0.5), dtype=torch.float64)
    logp_ref = torch.full((1, 2), math.log(0.25), dtype=torch.float64)
    return logp_new, logp_old, logp_ref, torch.zeros(1, dtype=torch.float64)


def test_kl_penalty_k3_value_and_gradient():
    logp_new, logp_old, logp_ref, advantages = _kl_batch()
    cfg = PolicyLossConfig(kl_coef=0.1)
    mask = torch.ones(1, 2)
    loss, metrics = policy_loss(logp_new, logp_old, advantages, mask, cfg, logp_ref=logp_ref)
    # k3 per token = exp(ln .25 - ln .5) - (ln .25 - ln .5) - 1 = ln 2 - 0.5 ~ 0.193147;
    # loss = 0.1 * 0.193147 = 0.0193147.
    torch.testing.assert_close(loss, torch.tensor(0.1 * (math.log(2) - 0.5), dtype=torch.float64))
    assert metrics["kl_ref"].item() == pytest.approx(math.log(2) - 0.5)
    assert metrics["pg_loss"].item() == 0.0
    loss.backward()
    # d k3 / d logp = 1 - exp(ref - logp) = 1 - 0.5; times 0.1, / 2 tokens = 0.025.
    torch.testing.assert_close(logp_new.grad, torch.full((1, 2), 0.025, dtype=torch.float64))


def test_kl_estimator_choice_and_reference_requirements():
    logp_new, logp_old, logp_ref, advantages = _kl_batch()
    mask = torch.ones(1, 2)
    k1_cfg = PolicyLossConfig(kl_coef=0.1, kl_estimator="k1")
    loss, _ = policy_loss(logp_new, logp_old, advantages, mask, k1_cfg, logp_ref=logp_ref)
    # k1 = ln .5 - ln .25 = ln 2.
    torch.testing.assert_close(loss, torch.tensor(0.1 * math.log(2), dtype=torch.float64))

    # A reference without a coefficient is reported but adds nothing.
    loss, metrics = policy_loss(
        logp_new, logp_old, advantages, mask, PolicyLossConfig(), logp_ref=logp_ref
    )
    assert loss.item() == 0.0
    assert metrics["kl_ref"].item() == pytest.approx(math.log(2) - 0.5)

    with pytest.raises(ValueError, match="logp_ref"):
        policy_loss(logp_new, logp_old, advantages, mask, PolicyLossConfig(kl_coef=0.1))


def test_gradient_flows_into_logp_new_only():
    logp_new, logp_old = _logps()
    logp_old.requires_grad_()
    logp_ref = torch.full((2, 3), math.log(0.2), dtype=torch.float64, requires_grad=True)
    advantages = ADVANTAGES.clone().requires_grad_()
    cfg = PolicyLossConfig(kl_coef=0.1)
    loss, _ = policy_loss(logp_new, logp_old, advantages, FULL_MASK, cfg, logp_ref=logp_ref)
    loss.backward()
    assert logp_new.grad is not None and logp_new.grad.abs().sum() > 0
    assert logp_old.grad is None
    assert logp_ref.grad is None
    assert advantages.grad is None


def test_log_ratio_is_clamped_before_exp():
    # log ratio = -0.5 - (-30) = 29.5 -> clamped to 20; with A = -1 the loss is exp(20),
    # not exp(29.5) ~ 6.5e12.
    logp_new = torch.tensor([[-0.5]], requires_grad=True)
    loss, _ = policy_loss(
        logp_new,
        torch.tensor([[-30.0]]),
        torch.tensor([-1.0]),
        torch.ones(1, 1),
        PolicyLossConfig(),
    )
    torch.testing.assert_close(loss, torch.tensor(math.exp(20)))
    # A log ratio of 1000 would overflow float32 without the clamp.
    huge, _ = policy_loss(
        torch.tensor([[0.0]]),
        torch.tensor([[-1000.0]]),
        torch.tensor([-1.0]),
        torch.ones(1, 1),
        PolicyLossConfig(),
    )
    assert torch.isfinite(huge)


def test_bf16_inputs_are_computed_in_float32():
    loss, _ = policy_loss(
        torch.full((1, 2), -1.0, dtype=torch.bfloat16, requires_grad=True),
        torch.full((1, 2), -1.0, dtype=torch.bfloat16),
        torch.tensor([0.5], dtype=torch.bfloat16),
        torch.ones(1, 2),
        PolicyLossConfig(),
    )
    assert loss.dtype == torch.float32
    assert loss.item() == -0.5


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_with_normalizer_reproduce_full_batch(aggregation):
    generator = torch.Generator().manual_seed(0)
    batch, length = 6, 5
    logp_old = -torch.rand(batch, length, generator=generator, dtype=torch.float64) * 3
    logp_new = (logp_old + 0.4 * torch.randn(batch, length, generator=generator,
                                             dtype=torch.float64)).requires_grad_()
    logp_ref = logp_old + 0.2 * torch.randn(batch, length, generator=generator, dtype=torch.float64)
    advantages = torch.randn(batch, generator=generator, dtype=torch.float64)
    lengths = torch.tensor([5, 1, 3, 4, 2, 5])
    mask = torch.arange(length)[None, :] < lengths[:, None]
    truncated = torch.tensor([True, False, False, False, False, True])
    cfg = PolicyLossConfig(
        aggregation=aggregation, kl_coef=0.05, dual_clip=3.0, mask_truncated=True
    )

    full_loss, _ = policy_loss(
        logp_new, logp_old, advantages, mask, cfg, logp_ref=logp_ref, truncated=truncated
    )
    (full_grad,) = torch.autograd.grad(full_loss, logp_new)

    splits = [slice(0, 2), slice(2, 6)]
    normalizer = sum(
        int(aggregation_denominator(valid_token_mask(mask[s], truncated[s], True), aggregation))
        for s in splits
    )
    micro_losses = [
        policy_loss(
            logp_new[s], logp_old[s], advantages[s], mask[s], cfg,
            logp_ref=logp_ref[s], truncated=truncated[s], normalizer=normalizer,
        )[0]
        for s in splits
    ]
    summed = sum(micro_losses)
    (micro_grad,) = torch.autograd.grad(summed, logp_new)
    torch.testing.assert_close(summed, full_loss)
    torch.testing.assert_close(micro_grad, full_grad)

    # Without the normalizer, averaging micro-batch losses (plain gradient accumulation)
    # weighs the two unequal micro-batches equally and misses the full-batch loss.
    local = [
        policy_loss(
            logp_new[s], logp_old[s], advantages[s], mask[s], cfg,
            logp_ref=logp_ref[s], truncated=truncated[s],
        )[0]
        for s in splits
    ]
    assert not torch.isclose(sum(local) / len(local), full_loss)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("clip_low", -0.1),
        ("clip_low", 1.0),
        ("clip_high", -0.2),
        ("dual_clip", 1.0),
        ("log_ratio_clamp", 0.0),
        ("kl_coef", -1.0),
        ("kl_estimator", "k4"),
        ("aggregation", "seq-sum"),
        ("mask_truncated", "yes"),
        ("importance_sampling_level", "sequence_token"),
        ("surrogate", "ppo"),
        ("cispo_weight_max", 1.0),
        ("mismatch_correction", "token"),
        ("mismatch_weight_max", -1.0),
        ("mismatch_weight_min", math.inf),
        ("top_entropy_quantile", 1.5),
    ],
)
def test_config_validation_names_the_bad_field(field, value):
    cfg = PolicyLossConfig(**{field: value})
    with pytest.raises(ValueError, match=field):
        cfg.validate()
    logp_new, logp_old = _logps()
    with pytest.raises(ValueError, match=field):
        policy_loss(logp_new, logp_old, ADVANTAGES, FULL_MASK, cfg)


def test_default_config_is_valid_and_shapes_are_checked():
    PolicyLossConfig().validate()
    logp_new, logp_old = _logps()
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp_new, logp_old, ADVANTAGES[:1], FULL_MASK, PolicyLossConfig())
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        policy_loss(logp_new, logp_old[:, :2], ADVANTAGES, FULL_MASK, PolicyLossConfig())


def test_gspo_clips_and_weights_whole_sequences():
    # Sequence ratios are geometric means: seq 0 (1.1 * 1.5 * 0.5)^(1/3) = 0.825^(1/3) = 0.937873,
    # A = +1, inside [0.8, 1.28]; seq 1 (0.9 * 0.5 * 4.0)^(1/3) = 1.8^(1/3) = 1.216440, A = -1,
    # unclipped. token-mean: (3 * -0.937873 + 3 * 1.216440) / 6.
    logp_new, logp_old = _logps()
    cfg = PolicyLossConfig(importance_sampling_level="sequence")
    loss, metrics = policy_loss(logp_new, logp_old, ADVANTAGES, FULL_MASK, cfg)
    s0, s1 = 0.825 ** (1 / 3), 1.8 ** (1 / 3)
    torch.testing.assert_close(loss, torch.tensor((s1 - s0) / 2, dtype=torch.float64))
    loss.backward()
    # d s / d logp_t = s / 3 for each of a sequence's 3 tokens; each sequence's loss weighs 3 / 6.
    expected = torch.tensor([[-s0] * 3, [s1] * 3], dtype=torch.float64) / 6
    torch.testing.assert_close(logp_new.grad, expected)
    assert metrics["clip_frac_low"].item() == metrics["clip_frac_high"].item() == 0.0

    # With the range [0.95, 1.1] and the advantages' signs flipped, seq 0 (A = -1, 0.938 < 0.95) is
    # low-clipped and seq 1 (A = +1, 1.216 > 1.1) high-clipped, each as a whole.
    logp_new.grad = None
    cfg = PolicyLossConfig(importance_sampling_level="sequence", clip_low=0.05, clip_high=0.1)
    loss, metrics = policy_loss(logp_new, logp_old, -ADVANTAGES, FULL_MASK, cfg)
    loss.backward()
    assert torch.equal(logp_new.grad, torch.zeros(2, 3, dtype=torch.float64))
    assert metrics["clip_frac_low"].item() == metrics["clip_frac_high"].item() == 0.5


def test_cispo_caps_the_weight_and_keeps_every_gradient():
    # Weights min(r, 1.3), detached: seq 0 [1.1, 1.3, 0.5], seq 1 [0.9, 0.5, 1.3]; per-token loss
    # -w * A * logp_new, so d / d logp_new = -w * A / 6 even where the clipped surrogate gives 0.
    logp_new, logp_old = _logps()
    cfg = PolicyLossConfig(surrogate="cispo", cispo_weight_max=1.3)
    loss, metrics = policy_loss(logp_new, logp_old, ADVANTAGES, FULL_MASK, cfg)
    weights = torch.tensor([[1.1, 1.3, 0.5], [0.9, 0.5, 1.3]], dtype=torch.float64)
    expected_loss = (-weights * ADVANTAGES[:, None] * logp_new.detach()).mean()
    torch.testing.assert_close(loss, expected_loss)
    loss.backward()
    torch.testing.assert_close(logp_new.grad, -weights * ADVANTAGES[:, None] / 6)
    assert metrics["cispo_clip_frac"].item() == pytest.approx(2 / 6)
    assert "clip_frac_low" not in metrics


@pytest.mark.parametrize(
    ("mode", "bounds", "weights", "flagged"),
    [
        # Token weights pi_old / pi_sampler = [0.5, 2, 4]; bounds [min, max].
        ("token_truncate", (None, 3.0), [0.5, 2.0, 3.0], [0, 0, 1]),
        ("token_truncate", (0.6, 3.0), [0.6, 2.0, 3.0], [1, 0, 1]),
        ("token_mask", (None, 3.0), [0.5, 2.0, 0.0], [0, 0, 1]),
        ("token_mask", (0.6, None), [0.0, 2.0, 4.0], [1, 0, 0]),
        # One weight per sequence: 0.5 * 2 * 4 = 4.
        ("sequence_truncate", (None, 3.0), [3.0, 3.0, 3.0], [1, 1, 1]),
        ("sequence_mask", (None, 3.0), [0.0, 0.0, 0.0], [1, 1, 1]),
        ("sequence_mask", (None, 5.0), [4.0, 4.0, 4.0], [0, 0, 0]),
    ],
)
def test_mismatch_weights_multiply_the_policy_loss(mode, bounds, weights, flagged):
    # Ratio 1 and A = +1: the per-token loss is -w, token-mean over 3 tokens.
    logp_old = torch.full((1, 3), math.log(0.1), dtype=torch.float64)
    logp_new = logp_old.clone().requires_grad_()
    logp_sampler = logp_old - torch.tensor([[0.5, 2.0, 4.0]], dtype=torch.float64).log()
    cfg = PolicyLossConfig(mismatch_correction=mode, mismatch_weight_min=bounds[0],
                           mismatch_weight_max=bounds[1])
    loss, metrics = policy_loss(logp_new, logp_old, torch.ones(1, dtype=torch.float64),
                                torch.ones(1, 3), cfg, logp_sampler=logp_sampler)
    w = torch.tensor([weights], dtype=torch.float64)
    torch.testing.assert_close(loss, -w.mean())
    loss.backward()
    torch.testing.assert_close(logp_new.grad, -w / 3)
    assert metrics["is_weight_mean"].item() == pytest.approx(sum(weights) / 3)
    assert metrics["is_clipped_frac"].item() == pytest.approx(sum(flagged) / 3)
    with pytest.raises(ValueError, match="logp_sampler"):
        policy_loss(logp_new, logp_old, torch.ones(1), torch.ones(1, 3), cfg)


def test_entropy_selected_tokens_carry_the_policy_gradient_only():
    # Valid entropies [0.1, 2.0, 1.0, 3.0] (the 5th token is padding, entropy 9): the 0.5 quantile
    # of [0.1, 1, 2, 3] is 1.5, so tokens 1 and 3 are kept.
    entropy = torch.tensor([[0.1, 2.0, 1.0, 3.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]]).bool()
    assert high_entropy_mask(entropy, mask, 0.5).tolist() == [[False, True, False, True, False]]
    assert high_entropy_mask(entropy, mask, 1.0).tolist() == [[True, True, True, True, False]]
    assert high_entropy_mask(entropy, mask, 0.0).tolist() == [[False, False, False, True, False]]
    assert not high_entropy_mask(entropy, torch.zeros_like(mask), 0.5).any()

    # Ratio 1, A = +1: kept tokens have loss -1, the others 0; token-mean over all 4 valid tokens.
    # The KL penalty (ref = 0.5 * p, k3 = ln 2 - 0.5) stays on every token.
    logp_old = torch.full((1, 5), math.log(0.5), dtype=torch.float64)
    logp_new = logp_old.clone().requires_grad_()
    logp_ref = torch.full((1, 5), math.log(0.25), dtype=torch.float64)
    cfg = PolicyLossConfig(top_entropy_quantile=0.5, kl_coef=0.1)
    loss, metrics = policy_loss(logp_new, logp_old, torch.ones(1, dtype=torch.float64), mask, cfg,
                                logp_ref=logp_ref, entropy=entropy)
    torch.testing.assert_close(loss, torch.tensor(-2 / 4 + 0.1 * (math.log(2) - 0.5), dtype=torch.float64))
    loss.backward()
    kl_grad = 0.1 * 0.5 / 4
    expected = torch.tensor([[kl_grad, kl_grad - 0.25, kl_grad, kl_grad - 0.25, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp_new.grad, expected)
    assert metrics["entropy_mask_frac"].item() == 0.5
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(logp_new, logp_old, torch.ones(1), mask, cfg, logp_ref=logp_ref)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"surrogate": "cispo", "aggregation": "seq-mean-token-mean"}, "token-mean"),
        ({"surrogate": "cispo", "dual_clip": 3.0}, "dual_clip"),
        ({"mismatch_correction": "token_truncate", "mismatch_weight_max": None}, "truncates nothing"),
        ({"mismatch_weight_min": 2.0, "mismatch_weight_max": 2.0}, "mismatch_weight_min"),
    ],
)
def test_refused_combinations(fields, message):
    with pytest.raises(ValueError, match=message):
        PolicyLossConfig(**fields).validate()


def test_soft_overlong_penalty_hand_worked():
    # L_max = 10, L_cache = 4: no penalty up to 6 tokens, then -1/4 per token, -1 at and past the cap.
    penalty = soft_overlong_penalty(torch.tensor([0, 6, 7, 9, 10, 12]), 10, 4)
    assert penalty.tolist() == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    with pytest.raises(ValueError, match="buffer_len"):
        soft_overlong_penalty(torch.tensor([1]), 10, 0)
