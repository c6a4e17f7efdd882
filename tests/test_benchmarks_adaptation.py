"""The adaptation benchmark: its summary by hand, and a tiny end-to-end run of every mode."""
import json
import math

import pytest

from specroll.benchmarks.adaptation import CEILING, VANILLA, across_seeds, goals, main, markdown_table, rate, summarize

ROUNDS, DRIFT_AT, PROMPTS, N = 5, 2, 2, 2


def row(tok_per_pass=None, tokens=100, gen_s=1.0, acceptance=(0.5, 0.25), update=None, same=1.0, **extra):
    out = {"tokens": tokens, "gen_s": gen_s, "tokens_per_s": tokens / gen_s, **extra}
    if tok_per_pass is not None:
        out |= {"tokens_per_step_mean": tok_per_pass, "acceptance_by_depth": list(acceptance), "head_version": 0,
                "same_as_vanilla": same}
    if update is not None:
        out["update"] = {"committed": update[0], "seconds": update[1]}
    return out


def test_summary_splits_at_the_drift_and_takes_ratios_of_totals():
    rounds = {VANILLA: [row(), row(), row(tokens=100, gen_s=1.0), row(tokens=300, gen_s=2.0)],
              "static": [row(2.0), row(2.2), row(1.5, acceptance=(0.4, 0.2), same=0.5), row(1.7, tokens=200, gen_s=3.0)],
              "every_step": [row(2.0, update=(True, 0.5)), row(2.0, update=(False, 0.25)),
                             row(1.8, update=(True, 0.25)), row(1.9, acceptance=(0.6, 0.3))]}
    s = summarize(rounds, drift_at=2)
    static, every = s["static"], s["every_step"]
    assert static["tokens_per_step_before"] == pytest.approx(2.1)
    assert static["tokens_per_step_after"] == pytest.approx(1.6)
    assert static["tokens_per_step_after_se"] == pytest.approx(0.1)  # sd 0.1 * sqrt(2) over sqrt(2) rounds
    assert static["tokens_per_step_late"] == pytest.approx(1.7)  # the later half of 2 rounds after: the last
    assert static["acceptance_by_depth_after"] == pytest.approx([0.45, 0.225])
    # After the drift vanilla made 400 tokens in 3 s, static 300 in 4 s: (300 / 4) / (400 / 3).
    assert s[VANILLA]["tokens_per_s_after"] == pytest.approx(400 / 3)
    assert static["speed_ratio_after_totals"] == pytest.approx((300 / 4) / (400 / 3))
    # Per round: 100 / 100 and (200 / 3) / 150, median of two = their mean.
    assert static["speed_ratio_after"] == pytest.approx((1.0 + 200 / 3 / 150) / 2)
    assert (static["update_attempts"], static["updates_committed"], static["update_s"]) == (0, 0, 0.0)
    # Paired by round against static: (1.8 - 1.5, 1.9 - 1.7) = (0.3, 0.2).
    assert every["gain_over_static_after"] == pytest.approx(0.25) and static["gain_over_static_after"] == 0
    assert every["gain_over_static_after_se"] == pytest.approx(0.05)
    assert (every["update_attempts"], every["updates_committed"]) == (3, 2)
    assert every["update_s"] == pytest.approx(1.0) and every["update_share_of_gen"] == pytest.approx(1.0 / 4)
    assert static["same_as_vanilla"] == pytest.approx(0.875) and every["same_as_vanilla"] == 1.0  # over all rounds


def test_each_mode_is_measured_against_what_heads_fit_for_the_drifted_policy_gain():
    rounds = {VANILLA: [row()] * 3, "static": [row(2.0), row(1.5), row(1.7)],
              "slow": [row(2.0), row(1.6), row(1.8)], CEILING: [row(2.0), row(1.9), row(2.1)]}
    s = summarize(rounds, drift_at=1)
    # Paired gains over static: slow (0.1, 0.1), the ceiling (0.4, 0.4); slow wins back a quarter.
    assert s[CEILING]["gain_over_static_after"] == pytest.approx(0.4)
    assert s["slow"]["share_of_ceiling_gain"] == pytest.approx(0.25) and s[CEILING]["share_of_ceiling_gain"] == 1
    assert goals(s)["static / ceiling tokens per pass"] == pytest.approx(1.6 / 2.0)
    assert "(25% of the ceiling's)" in markdown_table(s)


def test_goals_compare_the_modes_after_the_drift():
    summary = {VANILLA: {}, "static": {"tokens_per_step_after": 1.5}, "reflex": {"tokens_per_step_after": 1.6},
               "slow": {"tokens_per_step_after": 1.7},
               "both": {"tokens_per_step_after": 1.9, "update_attempts": 2, "update_share_of_gen": 0.01},
               "every_step": {"tokens_per_step_after": 1.95, "update_attempts": 10, "update_share_of_gen": 0.2}}
    g = goals(summary)
    assert g["both > slow > static"] and g["both >= reflex >= static"]
    assert g["both / every_step tokens per pass"] == pytest.approx(1.9 / 1.95) and g["both within 5% of every_step"]
    assert g["every_step / both updates"] == 5 and g["both runs >= 5x fewer updates"]
    assert g["both updates < 2% of generation time"]
    summary["slow"]["tokens_per_step_after"] = 1.4  # below static
    assert not goals(summary)["both > slow > static"]


def test_every_mode_runs_every_round_on_the_same_prompts(tmp_path):
    out = tmp_path / "bench.json"
    result = main(["--tiny", "--threads", "1", "--rounds", str(ROUNDS), "--drift-at", str(DRIFT_AT),
                   "--prompts", str(PROMPTS), "--n", str(N), "--max-new-tokens", "12", "--calibration-steps", "2",
                   "--min-records", "4", "--head-lr", "3e-3", "--json", str(out)])
    written = json.loads(out.read_text())
    rounds, summary = written["rounds"], written["summary"]
    modes = [VANILLA, "static", "reflex", "slow", "both", "every_step"]
    assert list(rounds) == modes and written["summary"] == json.loads(json.dumps(result["summary"]))
    for r in range(ROUNDS):
        assert {tuple(rounds[m][r]["prompt_indices"]) for m in modes} == {tuple(range(r * PROMPTS, (r + 1) * PROMPTS))}
        assert {rounds[m][r]["policy"] for m in modes} == {"A" if r < DRIFT_AT else "B"}
        assert all(rounds[m][r]["responses"] == PROMPTS * N and rounds[m][r]["round"] == r for m in modes)

    # Every mode sampled vanilla's responses: the modes differ only in what they drafted for them.
    assert all(r["same_as_vanilla"] == 1.0 for m in modes for r in rounds[m])
    # Static heads never change; reflex runs only where the mode has it, records only where the slow path does.
    assert all(r.get("update") is None and r["head_version"] == 0 for r in rounds["static"])
    assert all("reflex_on_share" in r for m in ("reflex", "both", "every_step") for r in rounds[m])
    assert all("reflex_on_share" not in r and "records" not in r for m in ("static",) for r in rounds[m])
    # every_step attempts an update every round once records exist (and some are held out to judge it:
    # the drift's round has only its own 4 responses, none held out); committed heads draft from the next round on.
    assert all(r["records"] > 0 and r["heads_to_train"] == [0, 1, 2, 3] for r in rounds["every_step"])
    assert [r["update"] is not None for r in rounds["every_step"]] == [r != DRIFT_AT for r in range(ROUNDS)]
    # The policy changes only at the drift: A's records age out there, B's accumulate.
    after_drift = rounds["every_step"][DRIFT_AT:]
    in_replay = [r["update"]["train_records"] + r["update"]["held_out_records"] for r in after_drift[1:]]
    assert in_replay == [sum(r["records"] for r in after_drift[: i + 1]) for i in range(1, len(after_drift))]
    for m in ("slow", "both", "every_step"):
        committed = [bool(r["update"] and r["update"]["committed"]) for r in rounds[m]]
        assert [r["head_version"] for r in rounds[m]] == [sum(committed[:r]) for r in range(ROUNDS)]

    # The detector's view of each round is kept once it has calibrated (2 rounds here), for tuning it.
    for m in ("slow", "both", "every_step"):
        assert all(r["drift_check"] is None for r in rounds[m][:2])
        assert rounds[m][-1]["drift_check"] is not None and len(rounds[m][-1]["drift_check"]["z"]) == 4

    # The summary and the table come from the rounds.
    after = {m: rounds[m][DRIFT_AT:] for m in modes}
    for m in modes[1:]:
        s = summary[m]
        per_round = [r["tokens_per_step_mean"] for r in after[m]]
        assert s["tokens_per_step_after"] == pytest.approx(sum(per_round) / len(per_round))
        assert s["speed_ratio_after_totals"] == pytest.approx(rate(after[m]) / rate(after[VANILLA]))
        ratios = sorted(r["tokens_per_s"] / v["tokens_per_s"] for r, v in zip(after[m], after[VANILLA]))
        assert s["speed_ratio_after"] == pytest.approx(ratios[len(ratios) // 2])  # 3 rounds after: the middle one
        assert s["update_attempts"] == sum(r.get("update") is not None for r in rounds[m])
        line = next(x for x in written["table"].splitlines() if x.startswith(f"| {m} |"))
        assert f"| {s['tokens_per_step_before']:.2f} | {s['tokens_per_step_after']:.2f} ± " in line
    assert summary["static"]["update_attempts"] == 0 and summary["every_step"]["update_attempts"] == ROUNDS - 1
    assert written["table"] == markdown_table(summarize(rounds, DRIFT_AT))
    assert all(not (isinstance(v, float) and math.isnan(v)) for s in summary.values() for v in s.values())

    png = out.with_suffix(".png")
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tree_records_and_the_acceptance_signal_reach_the_run(tmp_path):
    """--record-nodes tree sends more records from the same first round; --drift-signal reaches the detector."""
    common = ["--tiny", "--threads", "1", "--rounds", "3", "--drift-at", "1", "--prompts", "2", "--n", "2",
              "--max-new-tokens", "12", "--calibration-steps", "1", "--min-records", "4", "--modes", "static", "slow"]
    path = main(common + ["--json", str(tmp_path / "path.json")])
    tree = main(common + ["--record-nodes", "tree", "--drift-signal", "acceptance", "--heads-b", "trained",
                          "--json", str(tmp_path / "tree.json")])
    assert tree["rounds"]["slow"][0]["records"] > path["rounds"]["slow"][0]["records"] > 0
    # The ceiling drafts as static does (the same heads, prompts and seeds) until the drift, then with B's heads.
    ceiling, static = tree["rounds"][CEILING], tree["rounds"]["static"]
    assert ceiling[0]["tokens_per_step_mean"] == static[0]["tokens_per_step_mean"]
    assert [r["tokens_per_step_mean"] for r in ceiling[1:]] != [r["tokens_per_step_mean"] for r in static[1:]]
    assert tree["args"]["record_nodes"] == "tree" and tree["args"]["drift_signal"] == "acceptance"
    assert tree["rounds"]["slow"][-1]["drift_check"] is not None


def test_seeds_pool_into_a_mean_gain_and_a_count_of_goals_held():
    # Gains over static at three seeds: +0.1, -0.1, +0.3: mean +0.1, s.e. sd 0.2 / sqrt(3).
    summaries = [{"static": {"gain_over_static_after": 0.0}, "slow": {"gain_over_static_after": g}} for g in (0.1, -0.1, 0.3)]
    checks = [{"both > slow > static": held, "static / ceiling tokens per pass": 0.9} for held in (True, False, True)]
    pooled = across_seeds(summaries, checks)
    assert pooled["seeds"] == 3 and pooled["gains"]["slow"]["gain_over_static_after"] == pytest.approx(0.1)
    assert pooled["gains"]["slow"]["gain_over_static_after_se"] == pytest.approx(0.2 / math.sqrt(3))
    assert pooled["goals_held"] == {"both > slow > static": 2}  # ratios are not goals to count


def test_several_seeds_run_apart_and_pool(tmp_path):
    out = tmp_path / "seeds.json"
    result = main(["--tiny", "--threads", "1", "--rounds", "3", "--drift-at", "1", "--prompts", "2", "--n", "2",
                   "--max-new-tokens", "12", "--calibration-steps", "1", "--min-records", "4",
                   "--modes", "static", "every_step", "--seed", "5", "--seeds", "2", "--json", str(out)])
    written = json.loads(out.read_text())
    assert [r["seed"] for r in written["runs"]] == [5, 6] and written["across_seeds"]["seeds"] == 2
    gains = [r["summary"]["every_step"]["gain_over_static_after"] for r in result["runs"]]
    assert written["across_seeds"]["gains"]["every_step"]["gain_over_static_after"] == pytest.approx(sum(gains) / 2)
    for seed in (5, 6):  # each seed's own JSON and plot, as a single run writes them
        assert json.loads((tmp_path / f"seeds_seed{seed}.json").read_text())["args"]["seed"] == str(seed)
        assert (tmp_path / f"seeds_seed{seed}.png").stat().st_size > 1000


def test_a_built_policy_b_is_refused_more_synthetic_prompts_than_it_left_out(tmp_path):
    with pytest.raises(ValueError, match="300 synthetic prompts: the built policy B"):
        main(["--rounds", "300", "--prompts", "1", "--data-path", str(tmp_path / "absent.jsonl")])
