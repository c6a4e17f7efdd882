"""Device counters of verify passes, read once: hand-worked passes with a finished row riding along."""
from __future__ import annotations

import torch

from specroll.speculation.verification.pass_counts import PassCounts


def test_counts_cover_live_rows_only_and_read_as_numbers():
    counts = PassCounts(max_tokens=4, max_depth=3, device="cpu")
    # Row 0 accepted 2 drafts (3 tokens), row 1 none (1 token), row 2 has finished: it counts for nothing.
    accepted = torch.tensor([[True, True, False], [False, False, False], [True, True, True]])
    on_chain = torch.tensor([[True, False, True], [True, False, False], [True, True, True]])
    counts.add_pass(torch.tensor([3, 1, 4]), torch.tensor([True, True, False]), accepted, on_chain)
    counts.add_plain(torch.tensor([True, False, True]))
    read = counts.read()
    # Plain row-steps join the one-token passes in the histogram, not the drafted figures.
    assert read.tokens_per_step_hist == {1: 3, 3: 1}
    assert (read.drafted_response_steps, read.drafted_tokens, read.drafts_accepted) == (2, 4, 2)
    assert read.accepted_by_depth == [1, 1, 0] and read.reached_by_depth == [2, 1, 1]
    # Row 0's chain held its first emitted token (a draft) and its third (the bonus): one accepted draft.
    assert read.lookup_accepted == 1


def test_a_pass_past_a_stop_token_or_the_cap_counts_the_tokens_its_response_kept():
    counts = PassCounts(max_tokens=4, max_depth=3, device="cpu")
    accepted = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    counts.add_pass(torch.tensor([4, 2, 1]), torch.tensor([True, True, False]), accepted)
    # Row 0 hit a stop token at its second token; row 1 kept both; row 2 had finished.
    counts.count_kept(torch.tensor([4, 2, 0]), torch.tensor([2, 2, 0]))
    counts.add_plain(torch.tensor([True, True, False]))
    counts.count_kept(torch.tensor([1, 1, 0]), torch.tensor([1, 1, 0]))  # a plain step keeps its token
    read = counts.read()
    assert read.tokens_per_step_hist == {1: 2, 2: 2}
    assert (read.drafted_response_steps, read.drafted_tokens, read.drafts_accepted) == (2, 4, 2)
    assert read.accepted_by_depth == [2, 1, 1]  # as the rule judged the drafts
