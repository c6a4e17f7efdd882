"""Run checkpoints on real DeepSpeed (CPU, gloo): exact resume, atomicity, durability, rotation,
lineage (a rollback starts a branch), damage found and named, RNG states without pickle, export."""

import json
import os
import random
import shutil
import warnings
from dataclasses import asdict

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from specroll.learner import (
    CheckpointDamagedError,
    GRPOLearner,
    GRPOSamples,
    LearnerConfig,
    RngState,
    export_hf,
    latest_checkpoint,
    latest_intact_checkpoint,
    load_checkpoint,
    policy_weights,
    save_checkpoint,
    start_branch,
    verify_checkpoint,
)
from specroll.learner.checkpoint import HEADS_FILE, CompletionMarker, file_records
from specroll.models import CausalLM, build_tiny_model
from specroll.speculation.drafting.heads import HeadsMeta
from specroll.speculation.drafting.heads_state import HeadsState


def random_samples(n: int, seed: int) -> GRPOSamples:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 64, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen).tolist() for _ in range(n)]
    responses = [torch.randint(2, 64, (int(torch.randint(1, 8, (1,), generator=gen)),), generator=gen).tolist() for _ in range(n)]
    return GRPOSamples(prompts, responses, torch.randn(n, generator=gen))


def make_learner(zero_stage: int = 0, model: CausalLM | None = None) -> GRPOLearner:
    cfg = LearnerConfig(
        zero_stage=zero_stage,
        lr=1e-2,
        warmup_steps=2,
        lr_schedule="cosine",
        total_steps=10,
        mini_batch_size=4,
        micro_batch_tokens=16,
        device="cpu",
    )
    return GRPOLearner(model or build_tiny_model(), cfg)


def draw_random_numbers():
    return torch.rand(3).tolist(), random.random(), np.random.rand(2).tolist()


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_resume_continues_exactly(tmp_path, zero_stage):
    first, second = random_samples(8, seed=1), random_samples(8, seed=2)
    learner = make_learner(zero_stage)
    learner.update(first)
    heads = HeadsState(3, {"proj": torch.arange(6.0).reshape(2, 3)}, HeadsMeta("path", 2, 3, "fingerprint"),
                       consolidation={"detector": {"step": 4}})
    saved = save_checkpoint(
        learner,
        tmp_path,
        step=1,
        data_position={"epoch": 0, "next_prompt": 16},
        heads=heads,
        wandb_run_id="run-abc",
        run_config={"experiment": "resume-test"},
    )
    expected_draws = draw_random_numbers()
    expected = learner.update(second)
    expected_version, expected_weights = learner.policy_state_dict()

    # A fresh process would start from other weights: the checkpoint must supply everything.
    resumed = make_learner(zero_stage, model=build_tiny_model(seed=7))
    assert latest_checkpoint(tmp_path) == saved
    state = load_checkpoint(resumed, saved)
    assert draw_random_numbers() == expected_draws
    # 8 samples in mini-batches of 4: two optimizer steps per update.
    assert (state.step, state.policy_version, state.wandb_run_id) == (1, 2, "run-abc")
    assert state.data_position == {"epoch": 0, "next_prompt": 16}
    assert (state.heads.version, state.heads.meta) == (3, heads.meta)
    assert torch.equal(state.heads.state["proj"], heads.state["proj"])
    assert state.heads.consolidation == {"detector": {"step": 4}}
    assert state.config["run"] == {"experiment": "resume-test"}
    assert state.config["learner"]["zero_stage"] == zero_stage

    metrics = resumed.update(second)
    for key in ("train/loss", "train/lr", "train/grad_norm", "train/entropy"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-9), key
    version, weights = resumed.policy_state_dict()
    assert version == expected_version == 4
    for name, tensor in expected_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-6)


def test_heads_saved_as_plain_dicts_resume_as_heads_state(tmp_path):
    """`heads.pt` holds dicts (loaded with `weights_only`); the oldest lack "meta" and "consolidation"."""
    learner = make_learner()
    meta = HeadsMeta("path", 2, 3, "fingerprint")
    weights = {"proj": torch.arange(6.0).reshape(2, 3)}
    saved = [{"version": 1, "state": weights},
             {"version": 2, "state": weights, "meta": asdict(meta), "consolidation": {"detector": {"step": 4}}}]
    expected = [HeadsState(1, weights, None, None), HeadsState(2, weights, meta, {"detector": {"step": 4}})]
    for step, (heads, want) in enumerate(zip(saved, expected), start=1):
        path = save_checkpoint(learner, tmp_path, step=step)
        torch.save(heads, path / HEADS_FILE)
        (path / "COMPLETE").write_text(CompletionMarker(step, file_records(path)).to_json())
        resumed = load_checkpoint(learner, path).heads
        assert (resumed.version, resumed.meta, resumed.consolidation) == (want.version, want.meta, want.consolidation)
        assert torch.equal(resumed.state["proj"], weights["proj"])
    torch.save({"state": weights}, path / HEADS_FILE)
    with pytest.raises(ValueError, match=r"heads.pt lacks \['version'\] of the saved heads"):
        load_checkpoint(learner, path, verify=False)


def test_interrupted_saves_are_ignored_and_cleaned_up(tmp_path):
    learner = make_learner()
    learner.update(random_samples(4, seed=3))
    good = save_checkpoint(learner, tmp_path, step=1)
    # A save that fails after DeepSpeed wrote its files (the heads cannot be pickled) removes its own .tmp.
    with pytest.raises(Exception, match="Can't pickle"):
        save_checkpoint(learner, tmp_path, step=2, heads=HeadsState(1, {"not_picklable": lambda: None}, None))
    assert not (tmp_path / "step_00000002.tmp").exists()
    assert not (tmp_path / "step_00000002").exists()
    # A save killed midway leaves its .tmp behind.
    shutil.copytree(good, tmp_path / "step_00000002.tmp")
    (tmp_path / "step_00000002.tmp" / "COMPLETE").unlink()
    # A final-looking directory without the marker (e.g. copied by hand, half deleted).
    unmarked = tmp_path / "step_00000003"
    unmarked.mkdir()
    (unmarked / "state.json").write_text(json.dumps({"step": 3}))

    assert latest_checkpoint(tmp_path) == good
    with pytest.raises(ValueError, match="step_00000003 is not complete"):
        load_checkpoint(learner, unmarked)
    save_checkpoint(learner, tmp_path, step=4)
    assert not (tmp_path / "step_00000002.tmp").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000004"


def test_rotation_keeps_the_newest_k(tmp_path):
    learner = make_learner()
    for step in range(1, 5):
        save_checkpoint(learner, tmp_path, step=step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    assert latest_checkpoint(tmp_path / "missing") is None
    # One kept would leave nothing to fall back to when the newest is damaged.
    with pytest.raises(ValueError, match="keep_last must be >= 2 or None, got 1"):
        save_checkpoint(learner, tmp_path, step=5, keep_last=1)


def test_every_file_and_directory_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    synced, renamed = [], []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):  # records which file or directory each fsync flushed, then flushes it
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def rename(src, dst):
        renamed.append((str(src), len(synced)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    saved = save_checkpoint(make_learner(), tmp_path / "run", step=1, heads=HeadsState(1, {"w": torch.ones(2)}, None, None),
                            drafter=[{"n": 1}], draft_history=[{"next_text": 0, "texts": []}])
    tmp = f"{saved}.tmp"
    (synced_before,) = [n for src, n in renamed if src == tmp]
    expected = {tmp} | {f"{tmp}/{p.relative_to(saved)}" for p in saved.rglob("*")}
    assert expected <= set(synced[:synced_before])
    assert str(tmp_path / "run") in synced[synced_before:]  # the directory holding the new name
    assert {"heads.pt", "drafter.pt", "draft_history.pt", "state.json", "COMPLETE"} <= {p.name for p in saved.iterdir()}
    verify_checkpoint(saved)


def save_steps(learner, root, steps, branch: str, keep_last=None):
    """Checkpoints of `steps`, each tagged with its branch in the data position."""
    return [save_checkpoint(learner, root, step=step, data_position={"branch": branch}, keep_last=keep_last)
            for step in steps]


def branch_of(checkpoint) -> str:
    return json.loads((checkpoint / "state.json").read_text())["data_position"]["branch"]


def test_a_rollback_starts_a_branch_that_auto_never_leaves(tmp_path):
    learner = make_learner()
    old = save_steps(learner, tmp_path, [1, 2, 3, 4], "old")
    with pytest.warns(UserWarning, match=r"new branch: the checkpoints of the abandoned history "
                                         r"\(step_00000003, step_00000004\) are moved to .*abandoned"):
        assert start_branch(tmp_path, old[1]) is True
    assert latest_checkpoint(tmp_path) == old[1]  # what resume=auto takes after a crash now
    aside = [p for p in (tmp_path / "abandoned").rglob("step_*") if p.parent.parent.name == "abandoned"]
    assert sorted(p.name for p in aside) == ["step_00000003", "step_00000004"]
    assert all(branch_of(p) == "old" and verify_checkpoint(p).step for p in aside)  # kept whole

    new = save_steps(learner, tmp_path, [3, 4, 5], "new", keep_last=2)
    assert latest_checkpoint(tmp_path) == new[-1]
    # Pruning keeps the newest of the live lineage; the abandoned history stays where it was put.
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000004", "step_00000005"]
    assert [branch_of(p) for p in sorted(tmp_path.glob("step_*"))] == ["new", "new"]
    assert all(p.is_dir() for p in aside)
    # Resuming from the newest, or from a checkpoint of another run directory:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert start_branch(tmp_path, new[-1]) is False  # nothing to set aside, nothing to warn about
    with pytest.warns(UserWarning, match=r"\(step_00000004, step_00000005\)"):
        assert start_branch(tmp_path, aside[0]) is True
    assert latest_checkpoint(tmp_path) is None


def test_a_save_sets_aside_what_a_fallback_left_behind(tmp_path):
    learner = make_learner()
    older, newest = save_steps(learner, tmp_path, [1, 2], "old")
    truncate(newest / MODEL_STATES)
    with pytest.warns(UserWarning, match="falling back"):
        assert latest_intact_checkpoint(tmp_path) == older  # resume=auto continues from step 1 ...
    with pytest.warns(UserWarning, match=r"a checkpoint of step 2 is being saved: .*\(step_00000002\) are moved to"):
        saved = save_steps(learner, tmp_path, [2], "new", keep_last=2)[0]  # ... and saves step 2 again
    assert branch_of(saved) == "new" and verify_checkpoint(saved).step == 2
    (damaged,) = (tmp_path / "abandoned").glob("*/step_00000002")
    assert (damaged / MODEL_STATES).is_file() and branch_of(damaged) == "old"  # set aside, not deleted


MODEL_STATES = "deepspeed/mp_rank_00_model_states.pt"


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def two_checkpoints(tmp_path):
    learner = make_learner()
    learner.update(random_samples(4, seed=5))
    older = save_checkpoint(learner, tmp_path, step=1)
    learner.update(random_samples(4, seed=6))
    return learner, older, save_checkpoint(learner, tmp_path, step=2)


def test_the_marker_records_every_file_with_its_size(tmp_path):
    _, _, newest = two_checkpoints(tmp_path)
    recorded = json.loads((newest / "COMPLETE").read_text())
    on_disk = {p.relative_to(newest).as_posix(): p.stat().st_size for p in newest.rglob("*") if p.is_file()}
    del on_disk["COMPLETE"]
    assert {name: r["size"] for name, r in recorded["files"].items()} == on_disk
    assert recorded["step"] == 2 and MODEL_STATES in on_disk and "rng_rank0.pt" in on_disk


@pytest.mark.parametrize("damage, problem", [(truncate, r"\d+ bytes; \d+ were saved"),
                                             (flip_last_byte, "another sha256 than was saved")])
def test_a_damaged_newest_checkpoint_falls_back_naming_the_file(tmp_path, damage, problem):
    _, older, newest = two_checkpoints(tmp_path)
    damage(newest / MODEL_STATES)
    with pytest.warns(UserWarning, match=f"step_00000002 is damaged: {MODEL_STATES} has {problem}.*; falling back"):
        assert latest_intact_checkpoint(tmp_path) == older
    assert latest_checkpoint(tmp_path) == newest  # complete, just not intact
    assert load_checkpoint(make_learner(), older).step == 1


def test_an_explicit_damaged_checkpoint_fails_naming_the_file(tmp_path):
    learner, older, newest = two_checkpoints(tmp_path)
    truncate(newest / MODEL_STATES)
    with pytest.raises(CheckpointDamagedError, match=f"step_00000002 is damaged: {MODEL_STATES} has") as failure:
        load_checkpoint(learner, newest)
    assert failure.value.file == MODEL_STATES
    (older / "rng_rank0.pt").unlink()
    with pytest.raises(CheckpointDamagedError, match="step_00000001 is damaged: rng_rank0.pt is missing"):
        verify_checkpoint(older)
    # Nothing intact is left: no checkpoint rather than a damaged one, each named in a warning.
    with pytest.warns(UserWarning) as caught:
        assert latest_intact_checkpoint(tmp_path) is None
    assert [str(w.message).split(" is damaged: ")[1].split(" ")[0] for w in caught] == [MODEL_STATES, "rng_rank0.pt"]


def test_a_checkpoint_from_before_file_records_resumes_with_warnings(tmp_path):
    _, _, newest = two_checkpoints(tmp_path)
    # What save_checkpoint wrote before: a bare step in the marker and pickled numpy RNG states.
    (newest / "COMPLETE").write_text("2\n")
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                "cuda": None}, newest / "rng_rank0.pt")
    with pytest.warns(UserWarning) as caught:
        state = load_checkpoint(make_learner(), newest)
    assert state.step == 2
    messages = [str(w.message) for w in caught]
    assert any("predates file hashes" in text for text in messages)
    assert any("rng_rank0.pt holds RNG states in the old pickled format" in text for text in messages)


def test_rng_state_loads_without_pickle_and_restores_every_stream(tmp_path):
    random.gauss(0, 1), np.random.standard_normal()  # both cache a second normal draw: it is part of the state
    saved = save_checkpoint(make_learner(), tmp_path, step=1)
    expected = draw_random_numbers(), random.gauss(0, 1), np.random.standard_normal()
    raw = torch.load(saved / "rng_rank0.pt", weights_only=True)
    assert set(raw) == {f for f in RngState.__dataclass_fields__}
    RngState(**raw).restore()
    assert (draw_random_numbers(), random.gauss(0, 1), np.random.standard_normal()) == expected


def test_a_checkpoint_written_on_a_gpu_resumes_on_a_cpu_only_node(tmp_path, monkeypatch):
    """torch.save records each tensor's device: a GPU rank's files name cuda:0, which a node without
    CUDA reads only when the load maps it to the CPU (DeepSpeed maps its own files)."""
    heads = HeadsState(1, {"proj": torch.ones(2, 3)}, None, {"detector": {"step": 4}})
    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        saved = save_checkpoint(make_learner(), tmp_path, step=1, heads=heads, drafter=[{"w": torch.ones(2)}],
                                draft_history=[{"tokens": torch.arange(3)}])
    state = load_checkpoint(make_learner(), saved)
    loaded = [state.heads.state["proj"], state.drafter[0]["w"], state.draft_history[0]["tokens"]]
    assert [t.device.type for t in loaded] == ["cpu"] * 3


@pytest.mark.parametrize(
    "zero_stage, model, message",
    [
        (0, lambda: build_tiny_model(num_layers=3), "model.num_layers is 2 in the checkpoint but 3 now"),
        (0, lambda: build_tiny_model(name="other-model"), "model.name is 'tiny-llama' in the checkpoint but 'other-model' now"),
        (2, build_tiny_model, "learner.zero_stage is 0 in the checkpoint but 2 now"),
    ],
)
def test_incompatible_checkpoint_names_the_field(tmp_path, zero_stage, model, message):
    saved = save_checkpoint(make_learner(), tmp_path, step=1)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(make_learner(zero_stage, model=model()), saved)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_exported_directory_loads_in_transformers_with_the_same_logits(tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    learner = GRPOLearner(build_tiny_model(model_type, init_std=0.1), LearnerConfig(lr=1e-2, device="cpu"))
    learner.update(random_samples(4, seed=4))
    _, weights = learner.policy_state_dict()
    ours = CausalLM(learner.model_config)
    ours.load_state_dict(weights)

    out = export_hf(weights, learner.model_config, None, tmp_path / "hf")
    names = set(load_file(str(out / "model.safetensors")))
    assert ("lm_head.weight" in names) == (not learner.model_config.tie_word_embeddings)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids).logits, rtol=0, atol=1e-4)
    with pytest.raises(FileExistsError, match="not empty"):
        export_hf(ours, learner.model_config, None, out)


def test_export_writes_the_tokenizer(tmp_path, smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = build_tiny_model()
    out = export_hf(model, model.config, tokenizer, tmp_path / "hf")
    text = "GRPO samples G responses per prompt."
    assert AutoTokenizer.from_pretrained(out).encode(text) == tokenizer.encode(text)


@pytest.mark.parametrize("zero_stage, model_type", [(0, "llama"), (3, "llama"), (0, "qwen2")])
def test_policy_weights_read_a_checkpoint_without_a_learner(tmp_path, zero_stage, model_type):
    learner = make_learner(zero_stage, model=build_tiny_model(model_type))
    learner.update(random_samples(4, seed=7))
    saved = save_checkpoint(learner, tmp_path, step=1)
    _, expected = learner.policy_state_dict()
    config, weights = policy_weights(saved)
    assert config["model"] == learner.model_config.to_dict()
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(weights[name].float(), value.float(), rtol=0, atol=0, msg=name)
    damaged = next((saved / "deepspeed").glob("*model_states.pt"))  # ZeRO 3 names it per partition
    truncate(damaged)
    with pytest.raises(CheckpointDamagedError, match=f"deepspeed/{damaged.name}"):
        policy_weights(saved)
