"""`tools.compare_runs` on real runs of three loss variants: every run's held-out curve in one figure
with a legend naming each run, and each later run's responses counted against the first's."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specroll.configs import load_train_config
from specroll.telemetry.plots import plot_learning_curves
from specroll.tools.compare_runs import main
from specroll.train import run_training

CONF = Path(__file__).resolve().parents[1] / "conf"
VARIANTS = {"GRPO": [], "GSPO": ["learner/loss=gspo"], "CISPO": ["learner/loss=cispo"]}


@pytest.fixture(scope="module")
def variant_runs(ray_cluster, tmp_path_factory):
    """{label: run_dir} of three 1-step smoke runs at the same seed, evaluated before training and after it."""
    root = tmp_path_factory.mktemp("variants")
    runs = {}
    for label, overrides in VARIANTS.items():
        with initialize_config_dir(config_dir=str(CONF), version_base=None):
            cfg = load_train_config(compose("config", overrides=[
                "experiment=smoke", f"run_dir={root / label.lower()}", "checkpoint_every=0", "logger.console=false",
                "logger.rollouts=true", "total_steps=1", "eval_every=1", "eval.limit=2", "eval.batch_size=2",
                *overrides]))
        runs[label] = str(run_training(cfg).run_dir)
    return runs


def test_three_runs_curves_in_one_figure_named_by_label(variant_runs, tmp_path, capsys):
    png = tmp_path / "variants.png"
    args = [*variant_runs.values(), *(f"--label={label}" for label in variant_runs), "--plot", str(png)]
    out = main(args)
    assert list(out["runs"]) == ["GRPO", "GSPO", "CISPO"] and list(out["identity"]) == ["GSPO", "CISPO"]
    assert all([u for u, _ in curve] == [0, 1] for curve in out["held_out"].values())
    assert png.stat().st_size > 0
    for same in out["identity"].values():  # the same seed and initial policy: step 0 samples the same responses
        assert same["steps"][0]["identical"] == same["steps"][0]["responses"] == 4
    printed = capsys.readouterr().out
    assert "identical responses, GSPO and GRPO: " in printed and "identical responses, CISPO and GRPO: " in printed
    held_out = plot_learning_curves(out["runs"]).axes[1]
    assert [t.get_text() for t in held_out.get_legend().get_texts()] == ["GRPO", "GSPO", "CISPO"]


def test_labels_one_per_run_and_two_runs_at_least(variant_runs):
    runs = list(variant_runs.values())
    with pytest.raises(SystemExit):
        main([*runs, "--label", "GRPO", "--label", "GSPO"])
    with pytest.raises(SystemExit):
        main(runs[:1])
