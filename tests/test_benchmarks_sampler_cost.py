"""The sampler cost benchmark: plain decoding with each sampler side by side, on a tiny random policy."""
from __future__ import annotations

from specroll.benchmarks.sampler_cost import main


def test_each_concurrency_times_both_samplers_on_the_same_prompts(tmp_path):
    path = tmp_path / "sampler_cost.json"
    result = main(["--tiny", "--concurrency", "1", "3", "--max-new-tokens", "6", "--repeats", "2",
                   "--json", str(path)])
    assert path.is_file() and [row["concurrency"] for row in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert row["inverse_cdf_tokens_s"] > 0 and row["gumbel_tokens_s"] > 0
        assert row["ratio"] > 0 and row["ratio_se"] is not None
