"""The run's report (`specroll.run_report`): its table from the whole metrics.jsonl of a resumed run,
else from this launch's steps; where things are, as `describe` prints it; nothing drawn without steps."""
from pathlib import Path

from specroll.command_line import compose_train_config
from specroll.run_report import describe, summarize_run
from specroll.telemetry import MetricsLogger
from specroll.telemetry import metric_names as m

REWARDS = [0.0, 0.25, 0.5, 1.0]  # steps 0-3: the first launch ran 0-1, the resumed one 2-3


def config(run_dir: Path, jsonl: bool, total_steps: int = 4):
    return compose_train_config(["experiment=smoke", f"run_dir={run_dir}", f"total_steps={total_steps}",
                                 "logger.backend=none", "logger.console=false", f"logger.jsonl={str(jsonl).lower()}"])


def launch(cfg, first_step: int, last_step: int) -> tuple[list[dict], MetricsLogger]:
    logger = MetricsLogger(cfg.logger, cfg.run_dir, first_step=first_step)
    steps = [{m.REWARD_MEAN: REWARDS[step], m.STEP_TIME_S: 1.0} for step in range(first_step, last_step + 1)]
    for step, metrics in enumerate(steps, start=first_step):
        logger.log(step, metrics)
    logger.close()
    return steps, logger


def summary(cfg, steps, first_step, logger):
    return summarize_run(cfg, steps, first_step, logger, policy_version=4, data_position={"epoch": 0},
                         last_checkpoint=None, last_eval=None)


def test_a_resumed_run_reports_its_whole_history_from_metrics_jsonl(tmp_path):
    cfg = config(tmp_path / "run", jsonl=True)
    launch(cfg, 0, 1)
    steps, logger = launch(cfg, 2, 3)
    report = summary(cfg, steps, 2, logger)
    assert "reward mean, first -> last steps  0.00 -> 1.00" in report.table  # steps 0 to 3
    assert report.metrics == steps[-1] and report.metrics_file == str(tmp_path / "run" / "metrics.jsonl")
    assert Path(report.curves_file).read_bytes()[:4] == b"\x89PNG"
    described = describe(report).splitlines()
    assert described[0] == f"SpecRoll run in {tmp_path / 'run'}: steps 2-3 done, policy version 4"
    assert f"  checkpoints:  {tmp_path / 'run' / 'checkpoints'}   (latest: None)" in described
    assert described[-1] == report.table.splitlines()[-1] and "Summary:" in described


def test_without_metrics_jsonl_the_table_holds_this_launchs_steps(tmp_path):
    cfg = config(tmp_path / "run", jsonl=False)
    launch(cfg, 0, 1)
    steps, logger = launch(cfg, 2, 3)
    report = summary(cfg, steps, 2, logger)
    assert "reward mean, first -> last steps  0.50 -> 1.00" in report.table and report.metrics_file is None


def test_a_launch_with_no_steps_left_draws_nothing(tmp_path):
    cfg = config(tmp_path / "run", jsonl=False, total_steps=2)
    report = summary(cfg, [], 2, MetricsLogger(cfg.logger, cfg.run_dir, first_step=2))
    assert (report.curves_file, report.table, report.metrics) == (None, None, {})
    assert describe(report).startswith(f"SpecRoll run in {tmp_path / 'run'}: all 2 steps were already done")
