"""Group advantages and reward validation against hand-worked numbers."""

import math

import pytest
import torch

from specroll.grpo import check_rewards, group_advantages


def test_group_1001_scaled_by_sample_std():
    # mean = 0.5, deviations = +-0.5; sample variance = 4 * 0.25 / (4 - 1) = 1/3,
    # std = 1/sqrt(3) ~ 0.57735, so A = +-0.5 * sqrt(3) = +-sqrt(3)/2 ~ +-0.86603.
    advantages, zero_std = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, eps=0.0)
    half_root3 = math.sqrt(3) / 2
    torch.testing.assert_close(
        advantages, torch.tensor([half_root3, -half_root3, -half_root3, half_root3])
    )
    assert zero_std.tolist() == [False]


def test_group_1001_default_eps_barely_shrinks():
    # A = 0.5 / (1/sqrt(3) + 1e-6) = 0.8660239 (vs 0.8660254 without eps).
    advantages, _ = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64), 4)
    expected = 0.5 / (1 / math.sqrt(3) + 1e-6)
    torch.testing.assert_close(
        advantages, torch.tensor([expected, -expected, -expected, expected], dtype=torch.float64)
    )


def test_group_1001_without_std_is_dr_grpo():
    # A = r - mean = r - 0.5.
    advantages, _ = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, scale_by_std=False)
    torch.testing.assert_close(advantages, torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_groups_are_independent_and_2d_input_matches_flat():
    # Group 2 = [2, 0, 0, 0]: mean 0.5, deviations [1.5, -0.5, -0.5, -0.5],
    # sample variance (2.25 + 3 * 0.25) / 3 = 1, so A = deviations.
    flat = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 0.0])
    from_flat, _ = group_advantages(flat, 4, eps=0.0)
    from_2d, _ = group_advantages(flat.reshape(2, 4), 4, eps=0.0)
    group2 = torch.tensor([1.5, -0.5, -0.5, -0.5])
    torch.testing.assert_close(from_flat[4:], group2)
    torch.testing.assert_close(from_2d, from_flat)


def test_integer_rewards_are_accepted():
    advantages, _ = group_advantages(torch.tensor([1, 0, 0, 1]), 4, scale_by_std=False)
    torch.testing.assert_close(advantages, torch.tensor([0.5, -0.5, -0.5, 0.5]))


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_all_equal_group_gets_exact_zeros_and_is_flagged(scale_by_std):
    # 0.3 * 7 in float32: the mean rounds to 0.3 - 3e-8, so a naive (r - mean) / (std + eps)
    # would give ~0.03 instead of 0.
    rewards = torch.cat([torch.full((7,), 0.3), torch.tensor([1.0, 0, 0, 0, 0, 0, 0])])
    advantages, zero_std = group_advantages(rewards, 7, scale_by_std=scale_by_std)
    assert torch.equal(advantages[:7], torch.zeros(7))
    assert advantages[7:].abs().sum() > 0
    assert zero_std.tolist() == [True, False]


def test_group_of_one_is_rejected_with_clear_message():
    with pytest.raises(ValueError, match=r"group_size must be >= 2, got 1"):
        group_advantages(torch.tensor([1.0, 0.0]), 1)


def test_count_not_divisible_by_group_size_is_rejected():
    with pytest.raises(ValueError, match=r"5\) is not divisible by group_size \(2"):
        group_advantages(torch.ones(5), 2)


def test_2d_shape_must_match_group_size():
    with pytest.raises(ValueError, match="group_size=3"):
        group_advantages(torch.ones(2, 4), 3)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_reward_error_names_first_bad_index(bad):
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, bad, bad, 0.0])
    with pytest.raises(ValueError, match=r"reward at index 5 is"):
        group_advantages(rewards, 4)


def test_check_rewards_skip_drops_whole_groups():
    # Groups of 2: [1, 0] ok, [nan, 1] bad, [0, 1] ok, [inf, inf] bad.
    rewards = torch.tensor([1.0, 0.0, float("nan"), 1.0, 0.0, 1.0, float("inf"), float("inf")])
    keep, num_skipped = check_rewards(rewards, 2, on_invalid="skip")
    assert keep.tolist() == [True, True, False, False, True, True, False, False]
    assert num_skipped == 4
    advantages, _ = group_advantages(rewards[keep], 2)
    assert torch.isfinite(advantages).all()


def test_check_rewards_all_finite_keeps_everything():
    keep, num_skipped = check_rewards(torch.tensor([[1.0, 0.0], [0.5, 0.5]]), 2, "skip")
    assert keep.tolist() == [True] * 4
    assert num_skipped == 0


def test_check_rewards_error_mode_raises_and_unknown_mode_rejected():
    with pytest.raises(ValueError, match="index 2"):
        check_rewards(torch.tensor([1.0, 0.0, float("nan"), 1.0]), 2, on_invalid="error")
    with pytest.raises(ValueError, match="on_invalid"):
        check_rewards(torch.tensor([1.0, 0.0]), 2, on_invalid="drop")
