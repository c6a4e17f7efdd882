"""engine_vs_hf's side-by-side dtype comparison, on hand-made runs."""
from __future__ import annotations

import pytest

from specroll.benchmarks.engine_vs_hf import TimedBatch, dtype_speedups, parse_args


def test_dtype_speedups_compare_decode_steps_and_prefill_with_the_first_dtype():
    runs = [
        # fp32, ours: 2.0 s for 10 tokens, of which 0.5 s prefill, so 0.15 s per decode step
        TimedBatch("ours", 1, 0, tokens=10, wall_s=2.0, steps=10, prefill_s=0.5, live_rows=1.0, dtype="float32"),
        TimedBatch("ours", 1, 0, tokens=10, wall_s=1.0, steps=10, prefill_s=0.25, live_rows=1.0, dtype="bfloat16"),
        TimedBatch("hf", 1, 0, tokens=10, wall_s=4.0, steps=10, dtype="float32"),
        TimedBatch("hf", 1, 0, tokens=10, wall_s=2.5, steps=10, dtype="bfloat16"),
    ]
    ours, hf = dtype_speedups(runs, ["float32", "bfloat16"], ["ours", "hf"], [1])
    assert ours == pytest.approx({"batch_size": 1, "system": "ours", "dtype": "bfloat16", "over": "float32",
                                  "tokens_per_s_ratio": 2.0, "decode_step_speedup": 2.0, "prefill_speedup": 2.0})
    assert hf == pytest.approx({"batch_size": 1, "system": "hf", "dtype": "bfloat16", "over": "float32",
                                "tokens_per_s_ratio": 1.6})


def test_dtype_is_checked_before_any_model_loads():
    assert parse_args(["--dtype", "float32", "bfloat16"]).dtype == ["float32", "bfloat16"]
    for bad in (["--dtype", "int8"], ["--dtype", "bfloat16", "bfloat16"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
