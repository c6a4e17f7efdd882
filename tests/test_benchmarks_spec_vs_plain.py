"""The speculative benchmark: its oracle bound and ratio error on hand-worked numbers, and a run end to end."""
from __future__ import annotations

import math

import torch

from specroll.benchmarks.oracle import oracle_accepted, oracle_passes
from specroll.benchmarks.spec_vs_plain import main, plain_row_off, repeat_ratio_se

# Position j holds the policy's probability of the response token r_j (realised) and its
# largest probabilities at that position (top). The root is r_0; a tree predicts r_1, r_2 ...
REALISED = torch.tensor([1.0, 0.9, 0.8, 0.5, 0.3])
TOP = torch.tensor([[1.0, 0.0, 0.0], [0.9, 0.05, 0.05], [0.8, 0.15, 0.05], [0.5, 0.4, 0.1], [0.6, 0.3, 0.1]])


def test_a_perfect_drafter_accepts_the_path_until_better_nodes_fill_the_budget():
    # Path scores: 0.9, 0.72, 0.36, 0.108. One draft: r_1 (0.9). Two: r_2 (0.72) next, as no
    # sibling beats it. Three: r_3 (0.36) is outranked by nothing but its two ancestors.
    assert oracle_accepted(REALISED, TOP, 0, drafts=1, max_depth=4) == 1
    assert oracle_accepted(REALISED, TOP, 0, drafts=2, max_depth=4) == 2
    assert oracle_accepted(REALISED, TOP, 0, drafts=3, max_depth=4) == 3
    # r_4 (0.108) is outranked by its 3 ancestors and by a sibling at each of depths 2-4:
    # 0.9 x 0.15 = 0.135, 0.72 x 0.4 = 0.288, 0.36 x 0.6 = 0.216; it needs 7 drafts.
    assert oracle_accepted(REALISED, TOP, 0, drafts=6, max_depth=4) == 3
    assert oracle_accepted(REALISED, TOP, 0, drafts=7, max_depth=4) == 4


def test_the_oracle_stops_at_the_depth_limit_and_the_response_end():
    assert oracle_accepted(REALISED, TOP, 0, drafts=15, max_depth=2) == 2
    assert oracle_accepted(REALISED, TOP, 2, drafts=15, max_depth=4) == 2  # only r_3, r_4 are left


def test_a_likelier_sibling_takes_the_only_draft():
    realised = torch.tensor([1.0, 0.3, 0.9])
    top = torch.tensor([[1.0, 0.0], [0.6, 0.3], [0.9, 0.1]])
    assert oracle_accepted(realised, top, 0, drafts=1, max_depth=4) == 0
    assert oracle_accepted(realised, top, 0, drafts=2, max_depth=4) == 1


def test_the_oracle_walks_a_response_pass_by_pass_under_each_pass_budget():
    # One draft a pass: r_1 from r_0, then r_3 from r_2: 4 tokens in 2 passes.
    assert oracle_passes([(REALISED, TOP)], [2], max_depth=4) == (4, 2)
    # 15 drafts on the second pass: r_3 and r_4 both.
    assert oracle_passes([(REALISED, TOP)], [2, 16], max_depth=4) == (5, 2)


def test_the_ratio_standard_error_by_hand():
    # Ratios 1.1, 0.9, 1.0: mean 1.0, sample variance (0.01 + 0.01 + 0) / 2 = 0.01, s.e. 0.1 / sqrt(3).
    pairs = [(100.0, 110.0), (50.0, 45.0), (80.0, 80.0)]
    assert math.isclose(repeat_ratio_se(pairs), 0.1 / math.sqrt(3))
    assert repeat_ratio_se(pairs[:1]) is None


def test_a_plain_throughout_row_off_one_is_flagged_beyond_noise():
    plain = {"max_budget": 1, "speedup": 0.80, "speedup_se": 0.008}
    assert plain_row_off(plain)
    assert not plain_row_off(plain | {"speedup": 0.98})  # within the 3% tolerance
    assert not plain_row_off(plain | {"speedup": 0.90, "speedup_se": 0.04})  # within 3 s.e. (0.12)
    assert plain_row_off(plain | {"speedup": 1.10, "speedup_se": None})  # one repeat: the tolerance alone
    assert not plain_row_off(plain | {"max_budget": 4})  # trees ran in some repeat: any ratio may be real
    assert not plain_row_off(plain | {"max_budget": 0})  # no budgets recorded


def test_speculative_responses_are_the_plain_ones_token_for_token(smollm2, tmp_path):
    """End to end on SmolLM2 with its shipped heads and tree steps that skip host reads: at the
    benchmark's sampling settings every speculative response is the plain one for its seed,
    and the trees were accepted into (more than one token per verify step)."""
    result = main(["--concurrency", "2", "--grpo", "2x2", "--max-new-tokens", "12", "--budget", "fixed",
                   "--fixed-nodes", "4", "--sync-free-trees", "on", "--json", str(tmp_path / "out.json")])
    assert [row["setting"] for row in result["rows"]] == ["concurrency 2", "grpo 2x2"]
    for row in result["rows"]:
        assert row["same_responses"] == 1.0 and row["tokens_per_step"] > 1.0


def test_plain_decoding_reports_what_would_be_trees_would_carry(smollm2, tmp_path):
    """Where the budget decodes plain throughout (capacity 1), the would-be column holds the
    shipped heads' would-be tokens per pass, and the engine without would-be trees is timed beside."""
    result = main(["--concurrency", "2", "--grpo", "", "--max-new-tokens", "12", "--budget", "concurrency",
                   "--capacity", "1", "--would-be-every", "1", "--would-be-off-engine"])
    (row,) = result["rows"]
    assert row["max_budget"] == 1 and row["tokens_per_step"] == 1.0 and row["same_responses"] == 1.0
    assert row["would_be_tokens_per_step"] > 1.0 and row["would_be_vs_off"] > 0
