"""The weight-sync benchmark end to end on a tiny model: every stage and actor figure is reported, and both paths."""
import json
import math

import pytest

from specroll.benchmarks.weight_sync import STAGES, main


@pytest.mark.ray  # the benchmark starts a cluster of its own
def test_a_tiny_run_reports_every_stage_and_the_sync_between_actors(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")  # another cluster's address: the benchmark starts its own
    out = tmp_path / "sync.json"
    result = main(["--model", "tiny", "--dtype", "bfloat16", "--repeats", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == result
    assert (result["model"], result["dtype"], result["repeats"]) == ("tiny", "bfloat16", 1)
    assert result["parameters"] == 3_164_320  # 2 layers, SmolLM2's 49152-token vocabulary, untied LM head
    assert list(result["stages_s"]) == list(STAGES) and list(result["actors_s"]) == ["publish", "load", "sync_policy"]
    figures = [*result["stages_s"].values(), *result["actors_s"].values()]
    assert all(math.isfinite(s) and s >= 0 for s in figures)
    assert result["stages_total_s"] == sum(result["stages_s"].values())
    assert result["actors_s"]["sync_policy"] > 0
    payload = 3_164_320 * 2  # bfloat16
    paths = result["paths"]
    assert list(paths) == ["object_store", "collective"]
    assert paths["object_store"]["moved_bytes"] >= payload  # one object, aligned tensors
    assert paths["collective"]["moved_bytes"] >= payload  # learner rank 0's socket writes to its one replica
    assert all(f["sync_policy_s"] > 0 and set(f["peak_rss_bytes"]) == {"learner", "rollout"} for f in paths.values())
