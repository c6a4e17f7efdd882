"""The end-of-run table, by hand on a three-step history."""
import pytest

from specroll.telemetry.history import RunHistory
from specroll.telemetry.run_summary import first_and_last, format_summary, summary_rows, time_shares, weighted_mean

ROWS = [
    {"step": 0, "speculation/verify_steps": 10.0, "speculation/tokens_per_step": 1.0, "speculation/node_budget_mean": 1.0,
     "speculation/acceptance_depth_1": 0.0, "perf/gen_tokens_per_s": 10.0, "rollout/reward_mean": 0.0,
     "perf/step_time_s": 10.0, "timing_s/gen": 4.0, "timing_s/update": 5.0},
    {"step": 1, "speculation/verify_steps": 30.0, "speculation/tokens_per_step": 1.5, "speculation/drafted_tokens_per_step": 2.0,
     "speculation/node_budget_mean": 3.0, "speculation/acceptance_depth_1": 0.6, "speculation/acceptance_depth_2": 0.3,
     "perf/gen_tokens_per_s": 20.0, "rollout/reward_mean": 0.5, "perf/step_time_s": 10.0,
     "timing_s/gen": 3.0, "timing_s/update": 6.0},
    {"step": 2, "speculation/verify_steps": 10.0, "speculation/tokens_per_step": 1.0, "speculation/node_budget_mean": 1.0,
     "perf/gen_tokens_per_s": 30.0, "rollout/reward_mean": 1.0, "perf/step_time_s": 20.0,
     "timing_s/gen": 5.0, "timing_s/update": 10.0},
]


def test_pieces_by_hand():
    run = RunHistory("r", ROWS)
    assert weighted_mean(run, "speculation/tokens_per_step", "speculation/verify_steps") == pytest.approx((10 + 45 + 10) / 50)
    assert weighted_mean(run, "speculation/drafted_tokens_per_step", "speculation/verify_steps") == 2.0  # the one step that drafted
    assert first_and_last([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]) == (1.5, 7.5)  # quarters
    assert first_and_last([4.0]) == (4.0, 4.0)
    shares = time_shares(run)
    assert shares["timing_s/gen"] == pytest.approx(12 / 40) and shares["timing_s/update"] == pytest.approx(21 / 40)
    assert shares["other"] == pytest.approx(7 / 40) and "timing_s/checkpoint" not in shares


def test_table_by_hand():
    rows = dict(summary_rows(RunHistory("r", ROWS)))
    assert rows["tokens per verify pass"] == "2.00 where a tree was drafted, 1.30 overall"
    assert rows["acceptance by depth"] == "0.60 0.30"  # of the one step that drafted
    assert rows["reward mean, first -> last steps"] == "0.00 -> 1.00"
    assert rows["generation tokens/s"] == "20.0" and rows["step time, s (mean)"] == "13.3"
    assert rows["where the step's time went"] == "gen 30%, update 52%, other 18%"
    assert format_summary(RunHistory("r", ROWS)).splitlines()[0].startswith("  tokens per verify pass")


def test_a_vanilla_run_has_no_speculation_lines():
    rows = dict(summary_rows(RunHistory("r", [{"step": 0, "perf/gen_tokens_per_s": 5.0, "perf/step_time_s": 2.0}])))
    assert "tokens per verify pass" not in rows and rows["generation tokens/s"] == "5.0"


def test_plain_steps_show_what_trees_would_have_carried_and_why_plain():
    plain = {"speculation/verify_steps": 10.0, "speculation/tokens_per_step": 1.0, "speculation/node_budget_mean": 1.0,
             "speculation/would_be_nodes": 8.0, "perf/step_time_s": 1.0}
    history = [dict(plain, step=0, **{"speculation/would_be_tokens_per_step": 1.5, "speculation/would_be_passes": 10.0,
                                       "speculation/tree_step_cost": 3.0}),
               dict(plain, step=1, **{"speculation/would_be_tokens_per_step": 2.0, "speculation/would_be_passes": 30.0,
                                       "speculation/tree_step_cost": 2.8})]
    rows = dict(summary_rows(RunHistory("r", history)))
    assert rows["while decoding plain"] == ("trees would carry 1.88 tokens per verify pass (would-be, 8 nodes); "
                                            "plain chosen: a tree step costs 2.9 plain steps on this machine")
    without_profile = [{k: v for k, v in row.items() if k != "speculation/tree_step_cost"} for row in history]
    assert dict(summary_rows(RunHistory("r", without_profile)))["while decoding plain"].endswith(
        "; plain chosen by the budget policy")
    assert "while decoding plain" not in dict(summary_rows(RunHistory("r", ROWS)))  # no would-be tree scored


def test_held_out_accuracy_from_the_evaluations_written_includes_the_one_before_training():
    rows = [dict(ROWS[0], **{"eval/accuracy": 0.4}), dict(ROWS[1]), dict(ROWS[2], **{"eval/accuracy": 0.6})]
    assert dict(summary_rows(RunHistory("r", rows)))["held-out accuracy, first -> last eval"] == "0.40 -> 0.60"
    evaluations = [(0, 0.25), (1, 0.4), (3, 0.6)]  # (updates, accuracy), as evals/ holds them
    assert dict(summary_rows(RunHistory("r", rows, evaluations)))["held-out accuracy, first -> last eval"] == (
        "0.25 -> 0.60 (after 0 -> 3 updates)")
