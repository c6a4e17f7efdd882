"""Run histories read back from metrics.jsonl, the comparison record, and the figures drawn from both."""
import json

import pytest

from specroll.benchmarks.comparison_record import Comparison, ConcurrencyPoint, ModeRun, RolloutTrace, load_comparison
from specroll.configs import LoggerSection
from specroll.telemetry import MetricsLogger, plots
from specroll.telemetry import metric_names as m
from specroll.eval.evaluation import EvalReport, ProblemEval
from specroll.telemetry.history import RunHistory, eval_file, read_run, read_runs
from specroll.telemetry.run_summary import acceptance_by_depth

OFF = dict(backend="none", console=False)


def log_run(run_dir, rows):
    with MetricsLogger(LoggerSection(**OFF), run_dir) as logger:
        for step, metrics in enumerate(rows):
            logger.log(step, metrics)
    return run_dir


SPEC_ROWS = [
    {m.STEP_TIME_S: 2.0, m.TIME_GEN: 1.0, m.TIME_UPDATE: 0.5, m.TOKENS_PER_STEP: 1.5, m.acceptance_depth(1): 0.6,
     m.acceptance_depth(2): 0.2, m.VERIFY_STEPS: 10, m.DRAFTED_TOKENS_PER_STEP: 1.5, m.NODE_BUDGET_MEAN: 4.0,
     m.ACTIVE_ROWS_MEAN: 8.0, m.REWARD_MEAN: 0.25,
     m.HEAD_VERSION: 0, m.GEN_TOKENS_PER_S: 100.0},
    {m.STEP_TIME_S: 3.0, m.TIME_GEN: 2.0, m.TIME_UPDATE: 0.5, m.TIME_HEAD_SYNC: 0.1, m.TOKENS_PER_STEP: 1.7,
     m.VERIFY_STEPS: 30, m.DRAFTED_TOKENS_PER_STEP: 1.7,
     m.acceptance_depth(1): 0.8, m.acceptance_depth(2): 0.4, m.NODE_BUDGET_MEAN: 6.0, m.ACTIVE_ROWS_MEAN: 5.0,
     m.REWARD_MEAN: float("nan"), m.HEAD_VERSION: 1, m.GEN_TOKENS_PER_S: 120.0},
]


def test_a_run_reads_back_as_logged(tmp_path):
    run = read_run(log_run(tmp_path / "spec", SPEC_ROWS))
    assert run.name == "spec" and run.steps == [0, 1]
    assert run.series(m.TIME_HEAD_SYNC) == ([1], [0.1])  # only the step that logged it
    assert run.series(m.REWARD_MEAN) == ([0], [0.25])  # NaN was written as null
    assert run.series(m.ACCURACY) == ([], [])
    assert acceptance_by_depth(run) == pytest.approx([(0.6 * 10 + 0.8 * 30) / 40, (0.2 * 10 + 0.4 * 30) / 40])
    with pytest.raises(ValueError, match="not in the namespace"):
        run.series("speculation/tokens")
    # A line cut short by a crash is left out, as the sink does on resume.
    with (tmp_path / "spec" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "perf/st')
    assert read_run(tmp_path / "spec").steps == [0, 1]
    assert [r.name for r in read_runs({"a": tmp_path / "spec", "b": tmp_path / "spec" / "metrics.jsonl"})] == ["a", "b"]


def test_a_run_logged_under_a_renamed_family_reads_under_todays_names(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 0, "spec/tokens_per_step": 1.5, "spec/acceptance_depth_2": 0.25}) + "\n"
        + json.dumps({"step": 1, m.TOKENS_PER_STEP: 1.75}) + "\n")
    run = read_run(tmp_path)
    assert run.series(m.TOKENS_PER_STEP) == ([0, 1], [1.5, 1.75])
    assert run.series(m.acceptance_depth(2)) == ([0], [0.25])
    assert m.current_name("speculation/verify_steps") == "speculation/verify_steps"


def test_a_run_with_unknown_names_or_no_metrics_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="logger.jsonl"):
        read_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "perf/tokens": 1.0}) + "\n")
    with pytest.raises(ValueError, match="did you mean"):
        read_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 0}\n')
    with pytest.raises(ValueError, match="steps must be increasing"):
        read_run(tmp_path)


def evaluated(run_dir, updates, correct):
    """An evaluation after `updates` updates of the run in `run_dir`, right on the first `correct` of 4 problems."""
    problems = [ProblemEval(i, "", [], i < correct, float(i < correct), 0, 0) for i in range(4)]
    EvalReport(str(run_dir), updates, problems, ()).write(eval_file(run_dir, updates))


def test_a_run_reads_back_with_its_held_out_evaluations_and_its_curves_draw_them(tmp_path):
    run_dir = log_run(tmp_path / "spec", SPEC_ROWS)
    for updates, correct in ((0, 1), (2, 3)):
        evaluated(run_dir, updates, correct)
    run = read_run(run_dir)
    assert run.held_out == [(0, 0.25), (2, 0.75)]
    assert read_run(run_dir / "metrics.jsonl").held_out == run.held_out
    fig = plots.plot_run_curves(run)
    curve = {ax.get_title(): ax for ax in fig.axes}["held-out accuracy"].get_lines()[0]
    assert list(curve.get_xdata()) == [0, 2] and list(curve.get_ydata()) == [0.25, 0.75]


def test_run_curves_draw_every_panel_and_say_what_is_missing(tmp_path):
    spec = read_run(log_run(tmp_path / "spec", SPEC_ROWS))
    vanilla = RunHistory("vanilla", [{"step": 0, m.STEP_TIME_S: 1.5, m.TIME_GEN: 0.8}])
    fig = plots.plot_run_curves([spec, vanilla], tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles == ["throughput", "step time", "where the step's time goes: spec",
                      "where the step's time goes: vanilla", "tokens per verify pass (1 = no gain)",
                      "acceptance by depth", "node budget against active rows", "draft heads", "rewards",
                      "held-out accuracy"]
    by_title = {ax.get_title(): ax for ax in fig.axes}
    # The breakdown stacks the phases each step logged (missing ones as 0) under the whole step.
    breakdown = by_title["where the step's time goes: spec"]
    assert [t.get_text() for t in breakdown.get_legend().get_texts()] == ["gen", "update", "head_sync", "whole step"]
    top = breakdown.collections[-1].get_paths()[0].vertices[:, 1].max()
    assert top == pytest.approx(2.0 + 0.5 + 0.1)  # step 1: gen + update + head_sync
    acceptance = by_title["acceptance by depth"].get_lines()[0]
    # Weighted by verify passes, as the run's summary table.
    assert list(acceptance.get_xdata()) == [1, 2] and list(acceptance.get_ydata()) == pytest.approx([0.75, 0.35])
    vanilla_only = plots.plot_run_panel([vanilla], "heads")
    assert [t.get_text() for t in vanilla_only.axes[0].texts] == [
        "no speculation/head_version or heads/version or heads/updates in these runs"]
    assert [t.get_text() for t in plots.plot_run_panel([vanilla], "held_out").axes[0].texts] == [
        "no held-out evaluations (eval_every) in these runs"]
    with pytest.raises(ValueError, match="unknown panel 'speed'; panels: throughput"):
        plots.plot_run_panel([vanilla], "speed")


def comparison(tmp_path) -> Comparison:
    steps = read_run(log_run(tmp_path / "spec", SPEC_ROWS)).rows
    race = "tiny / synthetic"
    return Comparison(
        modes=[ModeRun(race, "vanilla", "vanilla", [{"step": 0, m.STEP_TIME_S: 2.5}, {"step": 1, m.STEP_TIME_S: 2.6}]),
               ModeRun(race, "speculation-both", "speculation", steps, "both", RolloutTrace([8, 8, 5, 2], [2, 2, 3, 8]),
                       {"gen_s": 1.5}),
               ModeRun("other", "vanilla", "vanilla", [])],
        concurrency=[ConcurrencyPoint(race, "speculation-both", 8, 1.3), ConcurrencyPoint(race, "speculation-both", 1, 1.6),
                     ConcurrencyPoint("other", "speculation-both", 1, 1.1)],
        settings={"seed": 0},
    )


def test_a_comparison_round_trips_through_its_json_and_feeds_the_plots(tmp_path):
    loaded = load_comparison(comparison(tmp_path).save(tmp_path / "c.json"))
    assert loaded == comparison(tmp_path)
    race = "tiny / synthetic"
    assert loaded.races() == [race, "other"]
    assert loaded.series(race, m.TOKENS_PER_STEP) == {"speculation-both": [1.5, 1.7]}
    assert loaded.speedups(race) == {"speculation-both": [(1, 1.6), (8, 1.3)]}
    fig = plots.plot_tokens_per_pass(loaded.series(race, m.TOKENS_PER_STEP))
    assert list(fig.axes[0].get_lines()[0].get_ydata()) == [1.5, 1.7]
    fig = plots.plot_budget_trace(loaded.traces(race), tmp_path / "trace.png")
    assert list(fig.axes[1].collections[0].get_offsets()[:, 0]) == [8, 8, 5, 2]  # budget against active rows
    fig = plots.plot_speedup_by_concurrency(loaded.speedups(race), tmp_path / "speedup.png")
    assert list(fig.axes[0].get_lines()[0].get_xdata()) == [1, 8]
    assert (tmp_path / "trace.png").stat().st_size > 0 and (tmp_path / "speedup.png").stat().st_size > 0
    assert plots.plot_run_curves([mode.history() for mode in loaded.modes_of(race)]).axes


def test_a_comparison_of_another_schema_or_with_bad_entries_is_refused(tmp_path):
    data = comparison(tmp_path).to_dict()
    path = tmp_path / "c.json"
    for change, message in (
        (lambda d: d.update(schema=2), "schema 2 is not 1"),
        (lambda d: d["modes"][1]["trace"]["node_budget"].pop(), "4 active_rows but 3 node_budget"),
        (lambda d: d["modes"][0]["steps"][0].update({"perf/speedup": 1.0}), "not in the namespace"),
        (lambda d: d["modes"][0].update(rollout="eagle"), "rollout must be one of"),
        (lambda d: d["modes"].append(d["modes"][0]), "appears twice in race"),
        (lambda d: d["modes"][0].pop("steps"), "steps"),
    ):
        broken = json.loads(json.dumps(data))
        change(broken)
        path.write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=message):
            load_comparison(path)
