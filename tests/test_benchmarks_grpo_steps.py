"""The GRPO-steps benchmark: its statistics by hand, and a tiny end-to-end run of both modes."""
import json
import math

import pytest

from specroll.benchmarks.grpo_steps import main, summarize, two_proportion_p, welch_p
from specroll.telemetry import metric_names as m


def test_two_proportion_p_matches_a_hand_worked_case():
    # 30/100 vs 50/100: pooled 0.4, se = sqrt(0.24 * 0.02) = 0.069282, z = -2.8868.
    assert two_proportion_p(30, 100, 50, 100) == pytest.approx(math.erfc(2.8868 / math.sqrt(2)), rel=1e-3)
    assert two_proportion_p(30, 100, 30, 100) == pytest.approx(1.0)
    assert two_proportion_p(0, 10, 0, 10) == 1.0  # no spread: nothing to tell apart


def test_welch_p_matches_hand_worked_cases():
    from scipy.stats import t

    # [1, 2, 3] vs [4, 6, 8, 10]: means 2 and 7, variances 1 and 20/3; se^2 = 1/3 + 5/3 = 2,
    # t = -5 / sqrt(2), Welch-Satterthwaite df = 2^2 / ((1/3)^2 / 2 + (5/3)^2 / 3) = 216/53.
    assert welch_p([1, 2, 3], [4, 6, 8, 10]) == pytest.approx(2 * t.sf(5 / math.sqrt(2), 216 / 53), rel=1e-9)
    # One sample constant: se^2 = 1/3, t = -2 sqrt(3), df = 2, where the two-sided p is 1 - |t| / sqrt(t^2 + 2).
    assert welch_p([0, 0, 0], [1, 2, 3]) == pytest.approx(1 - math.sqrt(12 / 14), rel=1e-9)
    # Both constant: the means are exact, so equal or not is certain.
    assert welch_p([0, 0, 0], [1, 1, 1]) == 0.0
    assert welch_p([0.5, 0.5], [0.5, 0.5]) == 1.0
    # Fewer than two values: no variance, nothing to test.
    assert welch_p([0], [1, 1, 1]) == 1.0 and welch_p([0, 1], [5]) == 1.0


def step(gen, total, reward, accuracy, n=8, length=10.0):
    return {m.TIME_GEN: gen, m.STEP_TIME_S: total, m.REWARD_MEAN: reward, m.ACCURACY: accuracy, m.NUM_SEQUENCES: n,
            m.RESPONSE_LENGTH_MEAN: length}


def test_summary_leaves_warmup_steps_out_of_the_ratios():
    results = {"vanilla": [step(100, 200, 0.25, 0.5), step(6, 10, 0.0, 0.25), step(6, 10, 0.25, 0.5)],
               "speculation": [step(1, 2, 0.5, 0.5), step(3, 7, 0.5, 0.5, length=20), step(3, 7, 0.25, 0.25)]}
    s = summarize(results, warmup=1)
    # tokens/s: vanilla (80 + 80) / 12, speculation (160 + 80) / 6 -> 3x, although generation time is only 2x
    assert s["gen_tokens_per_s_ratio"] == pytest.approx((240 / 6) / (160 / 12))
    assert s["gen_ratio"] == pytest.approx(12 / 6) and s["step_ratio"] == pytest.approx(20 / 14)
    assert s["vanilla_gen_share"] == pytest.approx(12 / 20) and s["speculation_gen_share"] == pytest.approx(6 / 14)
    assert s["vanilla_correct"] == pytest.approx(10) and s["vanilla_responses"] == 24
    assert s["speculation_reward_mean"] == pytest.approx(10 / 24)
    assert s["accuracy_p"] == pytest.approx(1.0)
    # Welch on every step's mean reward: means 1/6 and 5/12, both variances 1/48, so se = sqrt(2) / 12,
    # t = -3 / sqrt(2) and df = 4, where with x = |t| / sqrt(t^2 + 4) = 3 / sqrt(17) the two-sided
    # p is 1 - x (3 - x^2) / 2 = 1 - 63 / (17 sqrt(17)).
    assert s["reward_welch_p"] == pytest.approx(1 - 63 / (17 * math.sqrt(17)), rel=1e-9)


@pytest.mark.ray  # two runs of the driver, each on a local cluster it starts
def test_both_modes_train_side_by_side(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "bench.json"
    summary = main(["--policy", "tiny-llama", "--heads", "null", "--dataset", "synthetic", "--steps", "2",
                    "--prompts", "2", "--n", "2", "--max-new-tokens", "8", "--run-root", str(tmp_path / "runs"),
                    "--json", str(out), "experiment=smoke", "logger.console=false", "rollout.speculation.fixed_nodes=3"])
    written = json.loads(out.read_text())
    steps, warmup = written["steps"], written["args"]["warmup_steps"]
    assert [len(steps["vanilla"]), len(steps["speculation"])] == [2, 2]
    assert all(s[m.VERIFY_STEPS] > 0 and s[m.NODE_BUDGET_MEAN] == 3 for s in steps["speculation"])  # spec-only override
    assert all(m.VERIFY_STEPS not in s for s in steps["vanilla"])
    assert steps["vanilla"][1][m.POLICY_VERSION] == steps["speculation"][1][m.POLICY_VERSION] == 2
    assert summary["vanilla_responses"] == summary["speculation_responses"] == 2 * 2 * 2
    assert written["summary"] == summary
    # The ratios from the written per-step times, warm-up steps left out.
    for ratio, name in (("gen_ratio", m.TIME_GEN), ("step_ratio", m.STEP_TIME_S)):
        vanilla, specroll = (sum(s[name] for s in steps[mode][warmup:]) for mode in ("vanilla", "speculation"))
        assert vanilla > 0 and specroll > 0
        assert summary[ratio] == pytest.approx(vanilla / specroll, rel=1e-12)
