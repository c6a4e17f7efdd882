"""Aggregation modes on ragged masks, where they give different answers."""

import pytest
import torch

from specroll.grpo import aggregate, aggregation_denominator

# Sequence 0 has 3 valid tokens, sequence 1 has 1; the 99s are padding.
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # (1 + 2 + 3 + 4) / 4 tokens
        ("token-mean", 2.5),
        # (6/3 + 4/1) / 2 sequences
        ("seq-mean-token-mean", 3.0),
        # (6 + 4) / 2 sequences
        ("seq-mean-token-sum", 5.0),
    ],
)
def test_modes_on_ragged_mask(mode, expected):
    torch.testing.assert_close(aggregate(VALUES, MASK, mode), torch.tensor(expected))


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # (1 + 2 + 3 + 4) / 8
        ("token-mean", 1.25),
        # (2 + 4) / 8
        ("seq-mean-token-mean", 0.75),
        # (6 + 4) / 8
        ("seq-mean-token-sum", 1.25),
    ],
)
def test_normalizer_replaces_the_local_denominator(mode, expected):
    normalized = aggregate(VALUES, MASK, mode, normalizer=8.0)
    torch.testing.assert_close(normalized, torch.tensor(expected))


def test_seq_modes_do_not_count_empty_sequences():
    # Row 1 has no valid token: (1 + 2) / 2 over the one non-empty sequence, not / 2 rows.
    values = torch.tensor([[1.0, 2.0], [9.0, 9.0]])
    mask = torch.tensor([[True, True], [False, False]])
    torch.testing.assert_close(aggregate(values, mask, "seq-mean-token-mean"), torch.tensor(1.5))
    assert int(aggregation_denominator(mask, "seq-mean-token-sum")) == 1
    assert int(aggregation_denominator(mask, "token-mean")) == 2


def test_nan_padding_is_ignored_and_empty_mask_gives_zero():
    values = torch.tensor([[1.0, float("nan")], [float("-inf"), 3.0]])
    mask = torch.tensor([[1, 0], [0, 1]])
    torch.testing.assert_close(aggregate(values, mask, "token-mean"), torch.tensor(2.0))
    assert aggregate(values, torch.zeros_like(mask), "token-mean").item() == 0.0


def test_bad_arguments_rejected():
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(VALUES, MASK, "seq-sum")
    with pytest.raises(ValueError, match="normalizer"):
        aggregate(VALUES, MASK, "token-mean", normalizer=0.0)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        aggregate(VALUES, MASK[:, :2], "token-mean")
