"""A lost Ray cluster (its head node, GCS included, gone mid-step) is reported as the cluster's
loss, not as the death of whichever actor the driver was waiting on; the run exits non-zero
with resume advice, and resume=auto on a new cluster continues from the newest checkpoint."""
import json
from pathlib import Path

import pytest
import ray
from hydra import compose, initialize_config_dir
from ray.cluster_utils import Cluster

from specroll.configs import load_train_config
from specroll.command_line import errors_as_messages
from specroll.train import TRAIN, run_training

CONF = Path(__file__).resolve().parents[1] / "conf"
pytestmark = pytest.mark.ray  # clusters of its own, one of them lost


def config(run_dir, overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return load_train_config(compose("config", overrides=["experiment=smoke", f"run_dir={run_dir}",
                                                              "logger.console=false", *overrides]))


def test_a_lost_cluster_is_named_as_such_and_resume_auto_continues_on_a_new_one(tmp_path):
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "object_store_memory": 200 * 2**20,
                                                            "include_dashboard": False})

    def lose_the_head(step, phase, actors):
        if (step, phase) == (1, TRAIN):
            cluster.head_node.kill_all_processes(check_alive=False, allow_graceful=False)

    try:
        ray.init(address=cluster.address)
        with pytest.raises(SystemExit) as exited, errors_as_messages("error"):
            run_training(config(tmp_path, ["total_steps=3"]), on_phase=lose_the_head)
    finally:
        ray.shutdown()  # at once: Ray ends a process whose GCS stays gone for a minute
        cluster.shutdown()
    printed = str(exited.value.code)
    print(printed)  # the guide quotes it
    assert printed.startswith("error: the Ray cluster was lost during train (step 1)"), printed
    assert "died" not in printed.splitlines()[0]
    assert f"the last complete checkpoint is {tmp_path / 'checkpoints' / 'step_00000001'}; run again with resume=auto" in printed

    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        summary = run_training(config(tmp_path, ["total_steps=3"]))
    finally:
        ray.shutdown()
    assert summary.first_step == 1
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
