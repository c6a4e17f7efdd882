"""Bad inputs through the real driver (`run_training`, and `python -m specroll.train` itself): each
fails before Ray or any model starts, in one message naming the file, line or field, leaving an
existing run_dir byte for byte as it was and nothing in the launch directory; long prompts can be
dropped instead, with a count. A run_dir another live launch owns is refused the same way. And the local cluster a run starts for itself gives its actors the
driver's CPU priority and listens on the loopback address only."""
import ipaddress
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import ray
from hydra import compose, initialize_config_dir

from specroll.actors.ray_cluster import connect_ray
from specroll.actors.remote_calls import ActorFailedError, gather
from specroll.configs import ClusterSection, load_train_config
from specroll.preflight import PreflightError, preflight
from specroll.run_dir import SeesRunDir, unwritable, write_run_token
from specroll.run_owner import RunDirOwnedError, release_ownership, take_ownership
from specroll.train import run_training

ROOT = Path(__file__).resolve().parents[1]
CHECKOUT_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
FAST_S = 90  # far below a run's start (Ray, actors, models) on a busy 2-core machine; the checks take seconds
SHORT = "Tom has 3 apples and buys 2 more. How many apples does he have?"
LONG = "Count the words: " + "one " * 400  # > 256 tokens: over the smoke model's context
MEDIUM = "Count the words: " + "two " * 60  # fits the context, not learner.max_seq_len=120 with a response


def config(run_dir: Path, overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return load_train_config(compose("config", overrides=["experiment=smoke", f"run_dir={run_dir}",
                                                              "logger.console=false", *overrides]))


def problem_file(path: Path, questions: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"question": q, "answer": "#### 5"}) + "\n" for q in questions))
    return path


def earlier_run(tmp_path) -> Path:
    """A run_dir an earlier launch left: its config, metrics and a checkpoints folder."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("seed: 7  # the earlier launch's\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    return run_dir


def contents(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def fails_before_start(cfg) -> str:
    """The message `run_training(cfg)` stops with, checked to come before Ray (so any actor or model) started."""
    started = time.monotonic()
    with pytest.raises(PreflightError) as failure:
        run_training(cfg)
    assert time.monotonic() - started < FAST_S
    assert not ray.is_initialized()
    return str(failure.value)


@contextmanager
def read_only(folder: Path):
    """`folder` read-only even for root (immutable where chattr can), restored afterwards."""
    folder.chmod(0o555)
    immutable = os.geteuid() == 0 and shutil.which("chattr") is not None and \
        subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
    try:
        if unwritable(folder) is None:
            pytest.skip(f"cannot make {folder} read-only here (root without chattr +i)")
        yield folder
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        folder.chmod(0o755)


def test_an_empty_problem_file_is_named(tmp_path):
    run_dir, data = earlier_run(tmp_path), tmp_path / "empty.jsonl"
    data.write_text("")
    before = contents(run_dir)
    message = fails_before_start(config(run_dir, ["data=gsm8k", f"data.path={data}"]))
    assert message == f"the run cannot start: data.path: {data} holds no problems: the file is empty"
    assert contents(run_dir) == before


def test_a_long_prompt_fails_naming_its_line_and_length(tmp_path):
    run_dir = earlier_run(tmp_path)
    data = problem_file(tmp_path / "long.jsonl", [SHORT, SHORT, LONG, LONG])
    before = contents(run_dir)
    message = fails_before_start(config(run_dir, ["data=gsm8k", f"data.path={data}"]))
    assert message.startswith(f"the run cannot start: {data}:3: its prompt has ")
    tokens = int(message.split("its prompt has ")[1].split()[0])
    assert tokens > 256 and f"{tokens} + rollout.max_new_tokens (16) > learner.max_seq_len (256)" in message
    assert "2 of 4 prompts are that long (data.long_prompts=fail; drop leaves them out of the run)" in message
    assert contents(run_dir) == before


def test_a_prompt_with_no_room_for_its_response_in_the_learner_fails(tmp_path):
    run_dir = earlier_run(tmp_path)
    data = problem_file(tmp_path / "medium.jsonl", [SHORT, MEDIUM])
    before = contents(run_dir)
    message = fails_before_start(config(run_dir, ["data=gsm8k", f"data.path={data}", "learner.max_seq_len=120"]))
    tokens = int(message.split("its prompt has ")[1].split()[0])
    assert tokens + 16 > 120 and tokens < 256  # within the context: only the learner's length refuses it
    assert f"{data}:2: its prompt has {tokens} tokens, and {tokens} + rollout.max_new_tokens (16) > " \
           "learner.max_seq_len (120); 1 of 2 prompts are that long" in message
    assert contents(run_dir) == before


def test_long_prompts_are_dropped_with_a_count_and_never_reach_the_stream(tmp_path, caplog):
    data = problem_file(tmp_path / "long.jsonl", [SHORT, LONG, SHORT.replace("3", "4"), LONG])
    cfg = config(tmp_path / "run", ["data=gsm8k", f"data.path={data}", "data.long_prompts=drop"])
    with caplog.at_level(logging.WARNING, logger="specroll.preflight"):
        inputs = preflight(cfg)
    assert [p.source for p in inputs.problems] == [f"{data}:1", f"{data}:3"]  # the problems a run's stream is built of
    assert f"data.long_prompts=drop: left out 2 of 4 problems, whose prompt is longer than 240 tokens " \
           f"(learner.max_seq_len (256) less rollout.max_new_tokens (16)); the longest: {data}:" in caplog.text
    assert not (tmp_path / "run").exists()  # checking writes nothing

    only_long = problem_file(tmp_path / "only_long.jsonl", [LONG])
    message = fails_before_start(config(tmp_path / "run", ["data=gsm8k", f"data.path={only_long}",
                                                           "data.long_prompts=drop"]))
    assert "data.long_prompts=drop leaves no problem: all 1 prompts are longer than 240 tokens" in message


def test_a_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    run_dir, data = earlier_run(tmp_path), tmp_path / "latin1.jsonl"
    data.write_bytes(json.dumps({"question": SHORT, "answer": "#### 5"}).encode() + b"\n"
                     + '{"question": "Un caf\xe9 co\xfbte 3 euros", "answer": "#### 3"}\n'.encode("latin-1"))
    before = contents(run_dir)
    message = fails_before_start(config(run_dir, ["data=gsm8k", f"data.path={data}"]))
    assert message == (f"the run cannot start: data.path: {data}:2: not UTF-8 text (byte 0xe9 at column 21); "
                       "save the file as UTF-8")
    assert contents(run_dir) == before


def test_a_relative_path_that_exists_is_read_as_a_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    problem_file(tmp_path / "mydata" / "train.jsonl", [SHORT, LONG])  # a folder of splits, named without ./
    run_dir = earlier_run(tmp_path)
    before = contents(run_dir)
    message = fails_before_start(config(Path("run"), ["data=gsm8k", "data.path=mydata"]))
    assert f"the run cannot start: {tmp_path}/mydata/train.jsonl:2: its prompt has" in message
    assert contents(run_dir) == before


def test_read_only_run_dir_and_checkpoints_fail_with_everything_else_in_one_message(tmp_path):
    run_dir = earlier_run(tmp_path)
    data = problem_file(tmp_path / "long.jsonl", [LONG])
    before = contents(run_dir)
    with read_only(run_dir / "checkpoints"):
        message = fails_before_start(config(run_dir, ["data=gsm8k", f"data.path={data}",
                                                      "rollout.max_new_tokens=253", "learner.max_response_len=254"]))
    lines = message.splitlines()
    assert lines[0] == "the run cannot start (3 problems):"
    assert lines[1].startswith(f"  - run_dir's checkpoints folder: cannot write in {run_dir}/checkpoints: ")
    assert lines[2] == "  - rollout.max_new_tokens (253) + rollout.speculation.max_nodes (4) = 257 exceeds the " \
                       "context of model.name 'tiny-llama' (256 tokens)"
    assert lines[3].startswith(f"  - {data}:1: its prompt has ")
    with read_only(run_dir):
        message = fails_before_start(config(run_dir, []))
    assert message.startswith(f"the run cannot start: run_dir: cannot write in {run_dir}: ")
    assert contents(run_dir) == before


def test_a_run_dir_inside_rays_job_folder_is_refused_saying_what_to_do(tmp_path):
    job_dir = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123abcd"
    message = fails_before_start(config(job_dir / "runs" / "smoke", []))
    assert message == (f"the run cannot start: run_dir: {job_dir}/runs/smoke is inside Ray's per-job working "
                       "directory, which the next submission replaces (its checkpoints would be lost); set run_dir "
                       "to an absolute path on storage every node sees, e.g. run_dir=/mnt/shared/runs/NAME")
    assert not job_dir.exists()


def train_in_subprocess(tmp_path, overrides, **env):
    """`python -m specroll.train` as a user runs it, with Ray's session files (if any) under tmp_path."""
    return subprocess.run([sys.executable, "-m", "specroll.train", "experiment=smoke", *overrides], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={**CHECKOUT_ENV, "RAY_TMPDIR": str(tmp_path / "ray"), **env})


def test_the_command_prints_one_message_and_exits_1_before_ray_starts(tmp_path):
    run_dir = earlier_run(tmp_path)
    data = tmp_path / "latin1.jsonl"
    data.write_bytes('{"question": "caf\xe9?", "answer": "#### 1"}\n'.encode("latin-1"))
    before = contents(run_dir)
    with read_only(run_dir / "checkpoints"):
        result = train_in_subprocess(tmp_path, ["run_dir=run", "data=gsm8k", f"data.path={data.name}"])
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-3] == "error: the run cannot start (2 problems):"
    assert lines[-2].startswith(f"  - run_dir's checkpoints folder: cannot write in {run_dir}/checkpoints: ")
    assert lines[-1] == f"  - data.path: {data}:1: not UTF-8 text (byte 0xe9 at column 18); save the file as UTF-8"
    assert "Traceback" not in result.stderr and "Ray" not in result.stdout + result.stderr
    assert not (tmp_path / "ray").exists()  # no Ray session, so no actor and no model
    assert contents(run_dir) == before


def test_a_name_found_neither_here_nor_on_the_hub_fails_at_once(tmp_path):
    started = time.monotonic()
    result = train_in_subprocess(tmp_path, ["run_dir=run", "data=gsm8k", "data.path=mydta/gsm8k"], HF_HUB_OFFLINE="1")
    assert time.monotonic() - started < FAST_S
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"error: the run cannot start: data.path: 'mydta/gsm8k' is not a local file or folder (none under {tmp_path})")
    assert list(tmp_path.iterdir()) == []  # no run_dir, no Ray session, nothing of Hydra's


def test_an_unknown_model_is_named_once(tmp_path):
    result = train_in_subprocess(tmp_path, ["run_dir=run", "model.name=org/no-such-model", "model.tokenizer=null"],
                                 HF_HUB_OFFLINE="1")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: the run cannot start: model.name: unknown model 'org/no-such-model'")
    assert result.stderr.count("unknown model") == 1


def test_a_folder_where_the_run_token_goes_is_named_before_anything_is_written(tmp_path):
    run_dir = earlier_run(tmp_path)
    (run_dir / ".specroll-run").mkdir()
    before = contents(run_dir)
    message = fails_before_start(config(run_dir, []))
    assert message == (f"the run cannot start: run_dir: {run_dir / '.specroll-run'} is not a file, and a launch "
                       "writes that file (remove or rename it)")
    assert contents(run_dir) == before  # config.yaml as the earlier launch left it


def test_a_run_dir_a_live_launch_owns_is_refused_naming_it_before_anything_is_written(tmp_path):
    run_dir = earlier_run(tmp_path)
    owner = take_ownership(run_dir)  # as the live launch holds it: this process is that launch
    before = contents(run_dir)
    try:
        started = time.monotonic()
        with pytest.raises(RunDirOwnedError) as refused:
            run_training(config(run_dir, []))
        assert time.monotonic() - started < FAST_S and not ray.is_initialized()
        assert f"in use by another launch: {owner.describe()}" in str(refused.value)
        result = train_in_subprocess(tmp_path, ["run_dir=run"])
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith(
            f"error: run_dir {run_dir} is in use by another launch: {owner.describe()}")
        assert not (tmp_path / "ray").exists()
        assert contents(run_dir) == before  # config.yaml, metrics.jsonl, no token, the owner's record
    finally:
        release_ownership(run_dir, owner)


@pytest.mark.parametrize("override, says", [("total_steps=-1", "invalid config: total_steps must be an int >= 1"),
                                             ("total_step=3", "Could not override 'total_step'")])
def test_an_invalid_config_leaves_the_launch_directory_empty(tmp_path, override, says):
    result = train_in_subprocess(tmp_path, [override])
    assert result.returncode == 1 and says in result.stderr
    assert list(tmp_path.iterdir()) == []  # no outputs/<date>/<time>/ with .hydra/ and a .log


@pytest.mark.ray
def test_an_actor_that_does_not_see_the_run_dir_is_named(tmp_path):
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        token = write_run_token(tmp_path)
        witness = ray.remote(num_cpus=0)(SeesRunDir).remote()
        gather([("learner rank 1", witness.check_run_dir.remote(str(tmp_path), token))], "check_run_dir", 60)
        write_run_token(tmp_path)  # another launch, or another node's disk, holds another token
        with pytest.raises(ActorFailedError, match=r"learner rank 1 failed in check_run_dir: RunDirNotSharedError: "
                                                   r"node \S+ finds another launch's token at .*\.specroll-run"):
            gather([("learner rank 1", witness.check_run_dir.remote(str(tmp_path), token))], "check_run_dir", 60)
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        with pytest.raises(ActorFailedError, match="finds no token file at .*elsewhere/.specroll-run, where this "
                                                   "launch wrote [0-9a-f]+ from the driver on node .*: run_dir must "
                                                   "be on storage every node shares"):
            gather([("learner rank 1", witness.check_run_dir.remote(str(elsewhere), token))], "check_run_dir", 60)
    finally:
        ray.shutdown()


@pytest.mark.ray
def test_a_run_started_cluster_runs_its_actors_at_the_drivers_priority():
    # At Ray's default niceness (15) any other busy process on the machine starves the run's actors.
    class Niceness:  # defined here so that Ray ships it by value to a worker that cannot import tests/
        def of_this_process(self) -> int:
            return os.getpriority(os.PRIO_PROCESS, 0)

    assert connect_ray(ClusterSection())
    try:
        actor = ray.remote(num_cpus=0)(Niceness).remote()
        assert ray.get(actor.of_this_process.remote(), timeout=60) == os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        ray.shutdown()


def listening_beyond_loopback(pids: set[int]) -> list[str]:
    """Each LISTEN socket of `pids` bound to an address other than the loopback one: 'process address:port'."""
    found = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.status != psutil.CONN_LISTEN or conn.pid not in pids:
            continue
        address = ipaddress.ip_address(conn.laddr.ip.split("%")[0])
        mapped = getattr(address, "ipv4_mapped", None)
        if not (mapped or address).is_loopback:
            found.append(f"{psutil.Process(conn.pid).name()} {conn.laddr.ip}:{conn.laddr.port}")
    return found


@pytest.mark.ray
def test_a_local_run_listens_on_the_loopback_address_only(tmp_path):
    seen = {}

    def after_step(step, metrics, actors):  # the whole cluster is up: GCS, raylet, agents, every actor
        me = psutil.Process()
        pids = {me.pid} | {child.pid for child in me.children(recursive=True)}
        seen[step] = (len(pids), listening_beyond_loopback(pids))

    # Two learner ranks and the collective weight sync: both groups' rank 0 listen too.
    run_training(config(tmp_path / "run", ["total_steps=1", "checkpoint_every=0", "cluster.learner_world_size=2",
                                           "cluster.weight_sync=collective"]), on_step_end=after_step)
    processes, exposed = seen[0]
    assert processes > 5 and exposed == []
