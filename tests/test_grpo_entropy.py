"""Entropy from logits: uniform, hand-worked, extreme and masked cases."""

import math

import torch

from specroll.grpo import entropy_from_logits


def test_uniform_logits_give_log_vocab_size():
    logits = torch.zeros(2, 3, 7)
    entropy = entropy_from_logits(logits, torch.ones(2, 3))
    torch.testing.assert_close(entropy, torch.tensor(math.log(7)))


def test_two_token_distribution():
    # logits [0, ln 3] -> p = [1/4, 3/4]; H = -(0.25 ln 0.25 + 0.75 ln 0.75) ~ 0.562335.
    logits = torch.tensor([[[0.0, math.log(3)]]])
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    entropy = entropy_from_logits(logits, torch.ones(1, 1))
    torch.testing.assert_close(entropy, torch.tensor(expected))


def test_huge_bf16_logits_are_stable_and_float32():
    # Shifting every logit by 1e4 leaves the distribution uniform, but exp(1e4) overflows and
    # unshifted logsumexp(z) - sum p z loses float32 precision to cancellation.
    logits = torch.full((1, 2, 5), 1e4, dtype=torch.bfloat16)
    entropy = entropy_from_logits(logits, torch.ones(1, 2))
    assert entropy.dtype == torch.float32
    torch.testing.assert_close(entropy, torch.tensor(math.log(5)))


def test_banned_tokens_with_minus_inf_logits():
    # Two of three tokens allowed and equally likely: H = ln 2, and the gradient stays finite.
    logits = torch.tensor([[[0.0, 0.0, float("-inf")]]], requires_grad=True)
    entropy = entropy_from_logits(logits, torch.ones(1, 1))
    torch.testing.assert_close(entropy, torch.tensor(math.log(2)))
    entropy.backward()
    assert torch.isfinite(logits.grad).all()


def test_masked_positions_are_excluded():
    # Position 0 uniform over 4 (ln 4), position 1 peaked but masked out.
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [50.0, 0.0, 0.0, 0.0]]])
    mask = torch.tensor([[1, 0]])
    torch.testing.assert_close(entropy_from_logits(logits, mask), torch.tensor(math.log(4)))
