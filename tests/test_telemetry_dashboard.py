"""The W&B workspace, built offline: five non-empty sections, every chart drawn against the
training step and naming only defined metrics; the W&B sink defines that step as every family's x-axis."""
import re
from pathlib import Path

import pytest
import wandb

from specroll.configs import LoggerConfig
from specroll.telemetry import MetricsLogger
from specroll.telemetry import metric_names as m
from specroll.telemetry.dashboard import SECTIONS, build_workspace, main


def test_the_workspace_has_the_five_sections_each_non_empty():
    workspace = build_workspace("team", "specroll")
    assert (workspace.entity, workspace.project, workspace.name) == ("team", "specroll", "SpecRoll")
    assert [s.name for s in workspace.sections] == ["Throughput", "Step-time breakdown", "Speculation", "Adaptation",
                                                    "Learning"]
    assert all(section.panels for section in workspace.sections)
    assert workspace.settings.x_axis == m.STEP


def test_every_panel_names_defined_metrics_against_the_training_step():
    workspace = build_workspace("team", "specroll")
    panels = [panel for section in workspace.sections for panel in section.panels]
    assert len(panels) == sum(len(charts) for charts in SECTIONS.values())
    for panel in panels:
        assert panel.x == m.STEP
        assert panel.y, panel.title
        for name in panel.y:
            m.check_metric_name(name)
    named = {name for panel in panels for name in panel.y}
    assert set(m.family_names("timing_s")) <= named  # the breakdown stacks every phase
    assert {m.TOKENS_PER_STEP, m.acceptance_depth(1), m.HEADS_UPDATES, m.REWARD_MEAN} <= named
    assert {m.IS_WEIGHT_MEAN, m.IS_CLIPPED_FRAC, m.ENTROPY_MASK_FRAC, m.CISPO_CLIP_FRAC, m.OVERLONG_PENALTY_MEAN,
            m.RESAMPLED_GROUPS, m.KEPT_GROUPS, m.DROPPED_GROUPS, m.RESAMPLE_ROUNDS, m.STEP_SKIPPED} <= named
    assert m.TIME_RESAMPLE in named  # dynamic sampling's rounds in the step's breakdown
    stacked = [p.title for p in panels if p.plot_type == "stacked-area"]
    assert stacked == ["where the step's time goes (s)"]
    # The spec W&B would receive: built without the network, every metric in it defined.
    spec = workspace._spec["spec"]["section"]["panelBankConfig"]["sections"]
    assert [name for s in spec for p in s["panels"] for name in p["config"]["metrics"]] == [
        name for p in panels for name in p.y]


def test_saving_needs_an_entity():
    with pytest.raises(SystemExit):
        main(["--project", "specroll"])


def test_the_wandb_run_defines_every_family_against_the_step(offline_wandb):
    run_dir = offline_wandb / "run"
    with MetricsLogger(LoggerConfig(mode="offline", console=False), run_dir) as logger:
        logger.log(0, {m.LOSS: 1.0, m.STEP_TIME_S: 2.0})
    wandb.teardown()  # the offline file is complete once W&B's service has stopped
    record = next(Path(run_dir, "wandb").glob("offline-run-*/run-*.wandb")).read_bytes()
    for family in m.FAMILIES:  # a metric record: glob name, then (two bytes of protobuf framing) its step metric
        assert re.search(re.escape(f"{family}/*".encode()) + rb'"\n' + m.STEP.encode(), record), family
