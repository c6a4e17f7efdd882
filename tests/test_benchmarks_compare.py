"""The comparison command: its statistics on hand-worked cases, and the tiny path end to end
(real driver runs of three modes, engine-only concurrency, the JSON the notebook reads, plots)."""
import math

import pytest

from specroll.benchmarks.compare import add_ratios, homogeneity, main, summarize_mode
from specroll.benchmarks.comparison_record import ModeRun, load_comparison
from specroll.telemetry import metric_names as m


def row(step, gen, total, reward, accuracy, n=4, length=10.0, **extra):
    return {"step": step, m.TIME_GEN: gen, m.STEP_TIME_S: total, m.REWARD_MEAN: reward, m.ACCURACY: accuracy,
            m.NUM_SEQUENCES: n, m.RESPONSE_LENGTH_MEAN: length, **extra}


def mode(name, rows, warmup=1):
    rollout = name.split("-")[0]
    return ModeRun("race", name, rollout, rows, name.removeprefix("speculation-") if rollout == "speculation" else None,
                   summary=summarize_mode(rows, warmup))


def test_summary_and_ratios_against_vanilla_and_fastgrpo():
    vanilla = mode("vanilla", [row(0, 50, 90, 0.25, 0.25), row(1, 8, 20, 0.5, 0.5)])
    fast = mode("fastgrpo", [row(0, 50, 90, 0.5, 0.5, **{m.DRAFTER_UPDATES: 1, m.TIME_DRAFTER_UPDATE: 2.0}),
                             row(1, 6, 25, 0.25, 0.25, **{m.DRAFTER_UPDATES: 2, m.TIME_DRAFTER_UPDATE: 3.0,
                                                          m.TOKENS_PER_STEP: 1.5, m.acceptance_depth(1): 0.4})])
    both = mode("speculation-both", [row(0, 50, 90, 0.5, 0.5, **{m.HEADS_UPDATE_S: 4.0, m.HEADS_UPDATE_WAIT_S: 1.5}),
                                  row(1, 4, 16, 0.5, 0.5, **{m.TOKENS_PER_STEP: 2.0})])
    add_ratios([vanilla, fast, both])
    s = fast.summary
    assert (s["gen_s"], s["step_s"], s["drafter_updates"], s["drafter_update_s"]) == (6, 25, 2, 5.0)
    assert s["drafter_update_wait_s"] == 5.0  # FastGRPO's updates run inside its steps
    assert (both.summary["drafter_update_s"], both.summary["drafter_update_wait_s"]) == (4.0, 1.5)
    assert s["tokens_per_pass"] == 1.5 and s["acceptance_by_depth"] == [0.4]
    assert s["gen_tokens_per_s"] == pytest.approx(40 / 6)  # warm-up step left out
    assert (s["correct"], s["responses"]) == (3, 8) and s["reward_mean"] == pytest.approx(0.375)
    assert both.summary["gen_speedup_vs_vanilla"] == pytest.approx(8 / 4)
    assert both.summary["gen_speedup_vs_fastgrpo"] == pytest.approx(6 / 4)
    assert both.summary["step_speedup_vs_fastgrpo"] == pytest.approx(25 / 16)
    assert vanilla.summary["gen_speedup_vs_vanilla"] == 1.0
    # 3/8 vs 3/8 correct: pooled 0.375, no difference.
    assert fast.summary["accuracy_p_vs_vanilla"] == pytest.approx(1.0)


def test_homogeneity_of_rewards_across_modes():
    from scipy.stats import chi2

    same = [mode("vanilla", [row(0, 1, 1, 0.5, 0.5), row(1, 1, 1, 0.25, 0.25)]),
            mode("fastgrpo", [row(0, 1, 1, 0.25, 0.25), row(1, 1, 1, 0.5, 0.5)])]
    assert homogeneity(same) == {"accuracy_chi2_p": pytest.approx(1.0), "reward_kruskal_p": pytest.approx(1.0)}
    # 8/8 vs 0/8 correct: the table [[8, 0], [0, 8]] expects 4 in every cell; with Yates' correction
    # chi-square = 4 x (|8 - 4| - 0.5)^2 / 4 = 12.25, df 1.
    apart = [mode("vanilla", [row(0, 1, 1, 1.0, 1.0), row(1, 1, 1, 1.0, 1.0)]),
             mode("fastgrpo", [row(0, 1, 1, 0.0, 0.0), row(1, 1, 1, 0.0, 0.0)])]
    assert homogeneity(apart)["accuracy_chi2_p"] == pytest.approx(chi2.sf(12.25, 1))
    nothing = [mode("vanilla", [row(0, 1, 1, 0.0, 0.0), row(1, 1, 1, 0.0, 0.0)]),
               mode("fastgrpo", [row(0, 1, 1, 0.0, 0.0), row(1, 1, 1, 0.0, 0.0)])]
    assert homogeneity(nothing) == {"accuracy_chi2_p": 1.0, "reward_kruskal_p": 1.0}  # no spread: nothing to test


def test_the_tiny_path_races_modes_and_writes_what_the_notebook_reads(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out" / "compare.json"
    made = main(["--tiny", "--modes", "vanilla", "fastgrpo", "speculation-both", "--steps", "2", "--warmup-steps", "1",
                 "--prompts", "2", "--n", "2", "--max-new-tokens", "8", "--concurrency", "1", "2",
                 "--run-root", str(tmp_path / "runs"), "--json", str(out)])
    loaded = load_comparison(out)
    assert loaded.races() == ["tiny/synthetic"] and loaded.table == made.table
    runs = {run.name: run for run in loaded.modes}
    assert list(runs) == ["vanilla", "fastgrpo", "speculation-both"]
    assert [len(run.steps) for run in runs.values()] == [2, 2, 2]
    assert runs["vanilla"].trace is None and set(runs["fastgrpo"].trace.node_budget) == {2}  # C = 8 over 4 rows
    assert runs["fastgrpo"].summary["drafter_updates"] == 2 and runs["fastgrpo"].summary["drafter_update_s"] > 0
    assert runs["speculation-both"].steps[1][m.NODE_BUDGET_MEAN] == 4  # the smoke preset's fixed trees
    for run in runs.values():  # the ratios from the written per-step times, warm-up left out
        assert run.summary["gen_speedup_vs_vanilla"] == pytest.approx(
            runs["vanilla"].steps[1][m.TIME_GEN] / run.steps[1][m.TIME_GEN])
    assert {(p.mode, p.concurrency) for p in loaded.concurrency} == {
        (mode, c) for mode in ("fastgrpo", "speculation-both") for c in (1, 2)}
    assert all(math.isfinite(p.speedup) and p.speedup > 0 for p in loaded.concurrency)
    tests = loaded.settings["reward_tests"]["tiny/synthetic"]
    assert 0 <= tests["accuracy_chi2_p"] <= 1 and 0 <= tests["reward_kruskal_p"] <= 1
    assert "| fastgrpo |" in made.table and "GPU results (labelled as such; not measured here)" in made.table
    assert sorted(p.name for p in out.parent.glob("*.png")) == [
        "compare_tiny_synthetic_budget_vs_rows.png", "compare_tiny_synthetic_speedup_by_concurrency.png",
        "compare_tiny_synthetic_tokens_per_pass.png"]
