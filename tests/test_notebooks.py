"""The notebooks run top to bottom (nbclient, a real IPython kernel) on real tiny runs: two short
training runs of the driver (speculative and vanilla) for the run report, and a comparison JSON
built from those runs and real tiny-engine rollouts for the comparison notebook."""
import os
from pathlib import Path

import nbformat
import pytest
import ray
from hydra import compose, initialize_config_dir
from nbclient import NotebookClient

from specroll.benchmarks.comparison_record import Comparison, ConcurrencyPoint, ModeRun, RolloutTrace
from specroll.configs import load_train_config
from specroll.models import build_tiny_model
from specroll.rollout import GenerationStats, RolloutEngine, SamplingParams
from specroll.speculation import SpeculationConfig, SpeculativeDecoder
from specroll.telemetry.history import read_run
from specroll.train import run_training

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
pytestmark = pytest.mark.ray  # the run report notebook reads two real runs


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """Run directories of two 2-step runs of the smoke experiment: {"speculation": dir, "vanilla": dir}."""
    root = tmp_path_factory.mktemp("runs")
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    try:
        dirs = {}
        for rollout in ("speculation", "vanilla"):
            with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
                cfg = load_train_config(compose("config", overrides=[
                    "experiment=smoke", f"rollout={rollout}", f"run_dir={root / rollout}", "checkpoint_every=0",
                    "logger.console=false"]))
            dirs[rollout] = Path(run_training(cfg).run_dir)
        return dirs
    finally:
        ray.shutdown()


def tiny_rollout_stats(spec: SpeculationConfig | None, prompts: int) -> GenerationStats:
    model = build_tiny_model(init_std=0.3)
    engine = RolloutEngine(model, decoder=None if spec is None else SpeculativeDecoder(model, spec))
    return engine.generate([[3 + i, 4, 5] for i in range(prompts)], SamplingParams(max_new_tokens=12, n=2, seed=1)).stats


def comparison_of(runs: dict[str, Path]) -> Comparison:
    """The two runs' steps, the trace of a real speculative rollout, speedups of real tiny rollouts."""
    spec = SpeculationConfig(num_heads=3, budget="concurrency", capacity=16, max_nodes=8)
    stats = tiny_rollout_stats(spec, prompts=4)
    trace = RolloutTrace(stats.active_rows_per_step, stats.tree.budget_per_step)
    race = "tiny / synthetic"
    speedups = [ConcurrencyPoint(race, "speculation-static", 2 * count,
                                 tiny_rollout_stats(spec, count).tokens_per_s
                                 / tiny_rollout_stats(None, count).tokens_per_s)
                for count in (1, 4)]
    return Comparison(
        modes=[ModeRun(race, "vanilla", "vanilla", read_run(runs["vanilla"]).rows),
               ModeRun(race, "speculation-static", "speculation", read_run(runs["speculation"]).rows, "static", trace)],
        concurrency=speedups,
        settings={"steps": 2, "quick": True},
        table="| mode | steps |\n|---|---|\n| vanilla | 2 |\n| speculation-static | 2 |",
    )


def execute(name: str, **env: str) -> nbformat.NotebookNode:
    """The notebook executed in `notebooks/` by a kernel importing this checkout, with `env` set."""
    notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    kernel_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
                   ).execute(env=kernel_env)
    return notebook


def images(cell) -> int:
    return sum("image/png" in out.get("data", {}) for out in cell.outputs)


def test_notebooks_are_stored_without_outputs():
    for path in NOTEBOOKS.glob("*.ipynb"):
        notebook = nbformat.read(path, as_version=4)
        nbformat.validate(notebook)
        assert all(not c.get("outputs") for c in notebook.cells if c.cell_type == "code"), path


def test_run_report_runs_top_to_bottom_on_two_tiny_runs(tiny_runs):
    notebook = execute("run_report", SPECROLL_RUN_DIRS=os.pathsep.join(map(str, tiny_runs.values())))
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code)
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    assert "'speculation': 'steps 0-1', 'vanilla': 'steps 0-1'" in code[1].outputs[-1]["data"]["text/plain"]
    assert [images(c) for c in code[2:]] == [1] * (len(code) - 2)  # one figure per plotting cell
    assert (tiny_runs["speculation"] / "run_curves.png").stat().st_size > 0


def test_compare_runs_top_to_bottom_on_a_comparison_of_tiny_runs(tiny_runs, tmp_path):
    path = comparison_of(tiny_runs).save(tmp_path / "compare.json")
    notebook = execute("compare", SPECROLL_COMPARISON=str(path))
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code)
    assert "{'tiny / synthetic': ['vanilla', 'speculation-static']}" in code[1].outputs[-1]["data"]["text/plain"]
    assert "| speculation-static | 2 |" in code[2].outputs[-1]["data"]["text/markdown"]
    assert [images(c) for c in code[3:]] == [1, 1, 1, 1]  # one race: tokens per pass, trace, speedup, run panels
