"""GRPO samples -> padded micro-batches: token budgets, padding, normaliser, validation."""

import math

import pytest
import torch

from specroll.grpo import PolicyLossConfig
from specroll.learner import GRPOSamples, loss_normalizer, micro_batch_indices, mini_batch_indices, pad_samples


def make_samples(prompt_lens, response_lens, truncated=None) -> GRPOSamples:
    prompts = [[2 + (i + j) % 50 for j in range(n)] for i, n in enumerate(prompt_lens)]
    responses = [[3 + (2 * i + j) % 50 for j in range(n)] for i, n in enumerate(response_lens)]
    advantages = torch.linspace(-1, 1, len(prompt_lens))
    return GRPOSamples(prompts, responses, advantages, None if truncated is None else torch.tensor(truncated))


def test_micro_batches_fit_the_budget_and_group_similar_lengths():
    lengths = [10, 3, 9, 4, 10, 2, 8]
    groups = micro_batch_indices(lengths, list(range(7)), token_budget=20)
    # Longest first, ties by index: [0, 4] (2 x 10), [2, 6] (2 x 9), [3, 1, 5] (3 x 4).
    assert groups == [[0, 4], [2, 6], [3, 1, 5]]
    assert sorted(i for g in groups for i in g) == list(range(7))
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= 20


def test_sequence_over_budget_runs_alone():
    assert micro_batch_indices([50, 5, 5], [0, 1, 2], token_budget=12) == [[0], [1, 2]]


def test_sorting_by_length_pads_less_than_arrival_order():
    lengths = [2, 30, 3, 28, 4, 29, 2, 31]
    groups = micro_batch_indices(lengths, list(range(8)), token_budget=64)
    padded = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    arrival = [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert padded < sum(len(g) * max(lengths[i] for i in g) for g in arrival)
    assert padded == 2 * 31 + 2 * 29 + 4 * 4


def test_pad_samples_right_pads_and_aligns_responses():
    samples = make_samples([2, 4], [3, 1])
    old = [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-4.0])]
    mb = pad_samples(samples, [1, 0], old_logprobs=old)
    assert mb.indices.tolist() == [1, 0]
    assert mb.input_ids.shape == (2, 5)
    assert mb.input_ids[0].tolist() == samples.prompt_ids[1] + samples.response_ids[1]
    assert mb.input_ids[1, :5].tolist() == samples.prompt_ids[0] + samples.response_ids[0]
    assert mb.prompt_lens.tolist() == [4, 2] and mb.response_lens.tolist() == [1, 3]
    assert mb.old_logprobs.tolist() == [[-4.0, 0.0, 0.0], [-1.0, -2.0, -3.0]]
    assert mb.response_mask.tolist() == [[True, False, False], [True, True, True]]
    assert mb.advantages.tolist() == [samples.advantages[1].item(), samples.advantages[0].item()]


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_normaliser_is_the_mini_batch_denominator(aggregation):
    samples = make_samples([3, 2, 5, 1, 2], [4, 6, 1, 2, 3], truncated=[False, True, False, False, False])
    groups = micro_batch_indices(samples.sequence_lengths(), [0, 1, 2, 3, 4], token_budget=10)
    assert len(groups) >= 2
    batches = [pad_samples(samples, g) for g in groups]
    cfg = PolicyLossConfig(aggregation=aggregation, mask_truncated=True)
    # Sample 1 is truncated and masked: 4 + 1 + 2 + 3 tokens in 4 sequences.
    assert loss_normalizer(batches, cfg) == (10 if aggregation == "token-mean" else 4)


def test_mini_batches_partition_and_depend_only_on_the_seed():
    parts = mini_batch_indices(10, 4, torch.Generator().manual_seed(3))
    assert [len(p) for p in parts] == [4, 4, 2]
    assert sorted(i for p in parts for i in p) == list(range(10))
    assert parts == mini_batch_indices(10, 4, torch.Generator().manual_seed(3))
    assert [len(p) for p in mini_batch_indices(10, None, torch.Generator().manual_seed(3))] == [10]


def test_from_rollouts_computes_group_advantages():
    samples = GRPOSamples.from_rollouts(
        [[5]] * 4, [[6], [7], [8], [9]], [1.0, 0.0, 2.0, 2.0], group_size=2, truncated=[False, True, False, False]
    )
    # Group 0: mean 0.5, sample std sqrt(0.5); group 1 has equal rewards.
    assert samples.advantages.tolist() == pytest.approx([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5), 0.0, 0.0], abs=1e-5)
    assert samples.zero_std_groups.tolist() == [False, True]
    assert samples.truncated.tolist() == [False, True, False, False]


def test_from_rollouts_skips_groups_with_invalid_rewards():
    rewards = [1.0, 0.0, float("nan"), 1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="index 2"):
        GRPOSamples.from_rollouts([[5]] * 6, [[i + 6] for i in range(6)], rewards, group_size=2)
    samples = GRPOSamples.from_rollouts(
        [[5]] * 6, [[i + 6] for i in range(6)], rewards, group_size=2, on_invalid="skip"
    )
    assert samples.response_ids == [[6], [7], [10], [11]]
    assert samples.num_skipped == 2


def test_validation_names_the_bad_sample():
    with pytest.raises(ValueError, match="empty batch"):
        GRPOSamples([], [], torch.zeros(0)).validate(8, 16, 64)
    with pytest.raises(ValueError, match="sample 1: response has 9 tokens, more than max_response_len=8"):
        make_samples([2, 2], [3, 9]).validate(8, 16, 64)
    with pytest.raises(ValueError, match="sample 0: prompt \\+ response has 17 tokens"):
        make_samples([10, 2], [7, 1]).validate(8, 16, 64)
    with pytest.raises(ValueError, match="sample 0: token ids outside the vocabulary"):
        make_samples([2], [3]).validate(8, 16, 4)
    samples = make_samples([2], [3])
    samples.old_logprobs = [torch.zeros(2)]
    with pytest.raises(ValueError, match="sample 0: old_logprobs has shape \\(2,\\)"):
        samples.validate(8, 16, 64)
