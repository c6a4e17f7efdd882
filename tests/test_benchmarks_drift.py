"""The drift benchmark: a run's checkpoint read back as a policy, the KL by hand, and a tiny
end-to-end curve where noise on the policy hurts frozen heads and retraining recovers."""
import json
import math

import pytest
import torch

from specroll.benchmarks.drift import load_snapshot, main, markdown_table, mean_kl
from specroll.learner import GRPOLearner, GRPOSamples, LearnerConfig, save_checkpoint
from specroll.models import ModelConfig
from specroll.models import build_tiny_model


def test_a_checkpoint_loads_as_the_policy_it_holds(tmp_path):
    run_model = {"name": "tiny-llama", "dtype": "float32", "device": "cpu", "tokenizer": None}
    model, _ = ModelConfig(**run_model).load(seed=5)
    learner = GRPOLearner(model, LearnerConfig(lr=1e-2, mini_batch_size=2, micro_batch_tokens=16, device="cpu"))
    learner.update(GRPOSamples([[2, 3], [4, 5, 6]], [[7, 8, 9], [10]], torch.tensor([1.0, -1.0])))
    saved = save_checkpoint(learner, tmp_path, step=1, run_config={"model": run_model})
    _, trained = learner.policy_state_dict()

    loaded, _ = load_snapshot(str(saved), "float32", "cpu")
    state = loaded.state_dict()
    assert loaded.config.name == "tiny-llama" and state.keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(state[name], value), name
    untouched, _ = ModelConfig(**run_model).load(seed=5)
    assert not torch.equal(untouched.state_dict()["layers.0.mlp.down_proj.weight"],
                           state["layers.0.mlp.down_proj.weight"])  # the update is in the weights read back


def test_mean_kl_is_zero_for_the_same_policy_and_matches_a_hand_computation():
    a = build_tiny_model(vocab_size=64, seed=1)
    b = build_tiny_model(vocab_size=64, seed=2)
    ids = [[5, 6, 7, 8, 9], [3, 4, 5]]
    assert mean_kl(a, a, ids, [2, 2]) == pytest.approx(0.0, abs=1e-7)
    with torch.no_grad():
        expected, count = 0.0, 0
        for seq, start in zip(ids, [2, 2]):
            x = torch.tensor([seq])
            logp, logq = a(x).logits[0].log_softmax(-1), b(x).logits[0].log_softmax(-1)
            for t in range(start - 1, len(seq) - 1):  # the distributions that sampled tokens start..end
                expected += torch.sum(logp[t].exp() * (logp[t] - logq[t])).item()
                count += 1
    assert mean_kl(a, b, ids, [2, 2]) == pytest.approx(expected / count, rel=1e-5)


def test_a_drift_hurts_frozen_heads_and_the_curve_is_written(tmp_path):
    out = tmp_path / "drift.json"
    result = main(["--tiny", "3", "--threads", "1", "--prompts", "16", "--batch", "8", "--max-new-tokens", "24",
                   "--retrain-positions", "2000", "--retrain-max-new-tokens", "24", "--retrain-lr", "3e-3",
                   "--save-heads", str(tmp_path / "heads"), "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rows == json.loads(json.dumps(result["rows"]))
    assert [r["snapshot"] for r in rows] == [f"tiny {p} of the way to another" for p in ("0%", "50%", "100%")]
    kl = [r["kl_from_first"] for r in rows]
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and 0 < kl[1] < kl[2]
    frozen = [r["frozen"]["tokens_per_pass"] for r in rows]
    assert frozen[2] < frozen[0] - 0.05  # heads fit for the first policy draft worse for the last
    assert all(1.0 <= t <= 5.0 and not math.isnan(r["frozen"]["tokens_per_pass_se"]) for t, r in zip(frozen, rows))
    assert all(1.0 <= r["retrained"]["tokens_per_pass"] <= 5.0 for r in rows)
    saved = sorted((tmp_path / "heads").iterdir())
    assert [p.name for p in saved] == [f"{i}.heads.safetensors" for i in range(3)]
    assert saved[0].read_bytes() != saved[2].read_bytes()  # each snapshot's own retrained heads
    assert result["table"] == markdown_table(rows) and len(result["table"].splitlines()) == 2 + len(rows)
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
