"""The fault matrix: on the smoke preset, across three Ray nodes on this machine, each actor kind
(rollout, learner rank, head consolidation, driver) is killed as each phase of a step it takes
part in begins, then a rollback; and the actors on their own nodes run and resume.

Every case: the dead actor is named (the driver's death is a SIGKILL, its exit status -9), the
run exits non-zero with resume advice, the next launch (`resume=auto`) continues from the newest
checkpoint of the live lineage, and `metrics.jsonl` holds every step exactly once. The cases
form one chain in one run directory, each launch resuming where the one before died, so the
whole matrix costs one launch per case. Killing uses `ray.kill` from the driver's `on_phase`
callback (the driver: `tests/driver_killed_at_phase.py` in a subprocess).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from hydra import compose, initialize_config_dir
from ray.cluster_utils import Cluster

from specroll.configs import load_train_config
from specroll.learner import latest_checkpoint
from specroll.learner.lineage import ABANDONED, complete_checkpoints
from specroll.command_line import errors_as_messages
from specroll.train import GENERATE, HEAD_UPDATE, SAVE, TRAIN, WEIGHT_SYNC, run_training

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
pytestmark = pytest.mark.ray  # three raylets of its own
# One node per actor kind, each offering the custom resource the config places that kind by.
NODES = {"rollout_node": 2, "learner_node": 2, "consolidation_node": 1}
PLACED = ["+cluster.rollout_resources.rollout_node=1", "+cluster.learner_resources.learner_node=1",
          "+cluster.consolidation_resources.consolidation_node=1"]
# The slow path (without a trigger) gives the consolidation actor a part in weight sync and head updates.
SMOKE = ["experiment=smoke", "logger.console=false", "checkpoint_every=1", "keep_last=2", "cluster.phase_threads=false",
         "rollout.speculation.adaptation=slow", "rollout.speculation.drift.calibration_steps=2",
         "rollout.speculation.drift.min_records=1", *PLACED]
CONSOLIDATION = "head-consolidation actor"
# (who, phase it is killed at, what the failure says): every phase each kind takes part in.
MATRIX = [
    ("rollout actor 0", GENERATE, "rollout actor 0 died during generate"),
    ("rollout actor 0", WEIGHT_SYNC, "rollout actor 0 died during sync_policy"),
    ("rollout actor 0", HEAD_UPDATE, "rollout actor 0 died during decoder_checkpoint"),  # found at the save
    ("learner rank 0", WEIGHT_SYNC, "learner rank 0 died during sync_policy"),
    ("learner rank 0", TRAIN, "learner rank 0 died during train"),
    ("learner rank 0", SAVE, "learner rank 0 died during save_checkpoint"),
    (CONSOLIDATION, GENERATE, f"{CONSOLIDATION} died during consolidate"),  # rollout actors never call it
    (CONSOLIDATION, WEIGHT_SYNC, f"{CONSOLIDATION} died during sync_policy"),
    (CONSOLIDATION, HEAD_UPDATE, f"{CONSOLIDATION} died during consolidate"),
    (CONSOLIDATION, SAVE, f"{CONSOLIDATION} died during save_checkpoint"),  # not the learner whose save waited
    ("driver", SAVE, None),  # after the step's metrics line, before its checkpoint: the next launch redoes the step
    ("driver", GENERATE, None),
    ("driver", WEIGHT_SYNC, None),
    ("driver", HEAD_UPDATE, None),
    ("driver", TRAIN, None),
]
TOTAL_STEPS = len(MATRIX) + 8  # each case moves the run on by one or two steps: none reaches the end


@pytest.fixture(scope="module")
def nodes():
    """Three raylets on this machine: the head (the driver's) with the consolidation actor, and one
    node each for the rollout actors and the learner ranks."""
    names = list(NODES)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": NODES[names[-1]], "resources": {names[-1]: NODES[names[-1]]},
        "object_store_memory": 200 * 2**20, "include_dashboard": False})
    for name in names[:-1]:
        cluster.add_node(num_cpus=NODES[name], resources={name: NODES[name]}, object_store_memory=200 * 2**20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def config(run_dir, overrides=()):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return load_train_config(compose("config", overrides=[*SMOKE, f"run_dir={run_dir}", *overrides]))


def logged_steps(run_dir):
    return [json.loads(line)["step"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def resumable_step(run_dir):
    """The step `resume=auto` continues from: the newest checkpoint of the live lineage's."""
    newest = latest_checkpoint(Path(run_dir) / "checkpoints")
    return int(newest.name.split("_")[1]) if newest else 0


def actor_of(actors, who):
    return {"rollout actor 0": actors.rollout[0], "learner rank 0": actors.learners[0],
            CONSOLIDATION: actors.consolidation}[who]


def killed_in_process(run_dir, who, phase, at_step, overrides=()):
    """Launch with `ray.kill(who)` as `phase` of step `at_step` begins; (exit message, first step run)."""
    seen = []

    def kill(step, at_phase, actors):
        seen.append(step)
        if (step, at_phase) == (at_step, phase):
            ray.kill(actor_of(actors, who))

    with pytest.raises(SystemExit) as exited, errors_as_messages("error"):
        run_training(config(run_dir, [f"total_steps={TOTAL_STEPS}", *overrides]), on_phase=kill)
    return str(exited.value.code), seen[0]


def checkout_env() -> dict[str, str]:
    """This process's environment as it is now (ray.init sets RAY_AUTH_MODE in it, which a driver
    joining the same cluster needs), with the checkout importable."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def killed_driver(run_dir, phase, at_step, address):
    """Launch a driver in a subprocess that SIGKILLs itself as `phase` of step `at_step` begins."""
    overrides = [*SMOKE, f"run_dir={run_dir}", f"total_steps={TOTAL_STEPS}", f"cluster.ray_address={address}"]
    return subprocess.run([sys.executable, str(ROOT / "tests" / "driver_killed_at_phase.py"), str(at_step), phase,
                           *overrides], capture_output=True, text=True, env=checkout_env(), timeout=300)


def node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def test_each_actor_kind_runs_on_its_node_and_a_resume_continues(nodes, tmp_path):
    offering = {name: node["NodeID"] for node in ray.nodes() if node["Alive"] for name in node["Resources"]
                if name in NODES}
    placed = []

    def where(step, metrics, actors):
        placed.append({"rollout_node": node_of(actors.rollout[0]), "learner_node": node_of(actors.learners[0]),
                       "consolidation_node": node_of(actors.consolidation)})

    first = run_training(config(tmp_path / "run", ["total_steps=2"]), on_step_end=where)
    resumed = run_training(config(tmp_path / "run", ["total_steps=3"]), on_step_end=where)
    assert len(set(offering.values())) == 3 and placed == [offering] * 3
    assert (first.first_step, resumed.first_step, resumed.policy_version) == (0, 2, 3)
    assert logged_steps(tmp_path / "run") == [0, 1, 2]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """The run directory all cases share, each launch resuming where the one before died, and the
    matrix's rows (who, phase, resumed from, what was printed)."""
    return tmp_path_factory.mktemp("faults") / "run", []


@pytest.mark.parametrize("who, phase, says", MATRIX, ids=[f"{who.split()[0]}-{phase}" for who, phase, _ in MATRIX])
def test_a_death_in_each_phase_is_named_and_resume_auto_continues(nodes, chain, who, phase, says):
    run_dir, rows = chain
    resumes_at = resumable_step(run_dir)
    at_step = resumes_at + 1  # one whole step and its checkpoint first: each launch moves the run on
    if who == "driver":
        done = killed_driver(run_dir, phase, at_step, nodes.address)
        assert done.returncode == -9, done.stderr[-3000:]
        assert f"first step {resumes_at}" in done.stdout.splitlines()  # resumed at the newest checkpoint
        printed = f"(nothing: SIGKILL, exit status {done.returncode})"
    else:
        printed, first = killed_in_process(run_dir, who, phase, at_step)
        assert first == resumes_at  # resume=auto took the newest checkpoint of the live lineage
        assert printed.startswith(f"error: {says}"), printed
        newest = latest_checkpoint(run_dir / "checkpoints")
        assert f"the last complete checkpoint is {newest}; run again with resume=auto" in printed
    steps = logged_steps(run_dir)
    assert steps == list(range(len(steps))) and len(steps) >= at_step  # every step once, none lost
    if phase == SAVE:  # the step's line came before its checkpoint, which the death prevented
        assert len(steps) == at_step + 1 and resumable_step(run_dir) == at_step
    rows.append((who, phase, resumes_at, printed.splitlines()[0]))


def test_a_rollback_then_resume_auto_continues_the_new_branch(nodes, chain):
    run_dir, rows = chain
    if not latest_checkpoint(run_dir / "checkpoints"):  # run alone: a history to roll back first
        run_training(config(run_dir, ["total_steps=3"]))
    # resume=<the older of the two kept checkpoints> starts a branch, and dies in it ...
    older_step, older = complete_checkpoints(run_dir / "checkpoints")[-2]
    abandoned_step = resumable_step(run_dir)
    printed, first = killed_in_process(run_dir, "rollout actor 0", GENERATE, older_step + 1, [f"resume={older}"])
    assert first == older_step and printed.startswith("error: rollout actor 0 died during generate")
    assert any((run_dir / "checkpoints" / ABANDONED).glob(f"*/step_{abandoned_step:08d}"))
    assert logged_steps(run_dir) == list(range(older_step + 1))
    rows.append(("rollout actor 0", f"{GENERATE} after resume={older.name}", older_step, printed.splitlines()[0]))
    # ... and resume=auto continues the new branch, not the abandoned history.
    summary = run_training(config(run_dir, [f"total_steps={TOTAL_STEPS}"]))
    assert summary.first_step == older_step + 1 and resumable_step(run_dir) == TOTAL_STEPS
    assert logged_steps(run_dir) == list(range(TOTAL_STEPS))
    print("\nthe fault matrix (who, phase, resumed from, printed):")
    print("\n".join(f"{who:25} {phase:36} {step:3}  {said}" for who, phase, step, said in rows))
