"""History lookup through the driver on a real local Ray cluster with a tiny model: each rollout
actor keeps its own responses per prompt, a checkpoint saves them, and a resumed run's actors
hold them again and go on adding to them."""
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from specroll.actors import RolloutActor
from specroll.configs import load_train_config
from specroll.data import load_problems
from specroll.learner.checkpoint import DRAFT_HISTORY_FILE
from specroll.rollout.decoder import DecoderCheckpoint
from specroll.train import run_training

CONF = Path(__file__).resolve().parents[1] / "conf"


def config(tmp_path, overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return load_train_config(compose("config", overrides=[
            "experiment=smoke", "rollout.speculation.history_lookup=true", "rollout.speculation.sibling_lookup=true",
            "cluster.num_rollout_actors=2", f"run_dir={tmp_path / 'run'}", "logger.console=false", *overrides]))


def test_a_rollout_actor_keeps_its_responses_and_takes_them_back_from_a_file(tmp_path):
    """In-process (no Ray): what a checkpoint holds of one actor's history restores another actor."""
    torch.set_num_threads(1)
    cfg = config(tmp_path, [])
    actor = RolloutActor(cfg, index=0)
    problems = load_problems("synthetic", synthetic=cfg.data.synthetic)[:2]
    out = actor.generate(0, None, list(enumerate(problems)))
    state = actor.decoder_checkpoint().draft_history
    texts = [tokens for _, _, tokens in state["texts"]]
    assert len(texts) == 4 and [t[3:] for t in texts] == out.response_ids  # prompt tail, then the response
    torch.save([state], tmp_path / "draft_history.pt")
    fresh = RolloutActor(cfg, index=1)
    fresh.load_decoder_checkpoint(DecoderCheckpoint(draft_history=torch.load(tmp_path / "draft_history.pt",
                                                                             weights_only=True)[0]))
    assert fresh.decoder_checkpoint().draft_history == state
    fresh.generate(1, None, list(enumerate(problems)))  # the same prompts again: their history grows
    grown = fresh.decoder_checkpoint().draft_history
    assert grown["texts"][:4] == state["texts"] and grown["next_text"] == 8


def test_each_rollout_actor_resumes_its_draft_history(ray_cluster, tmp_path):
    summary = run_training(config(tmp_path, ["total_steps=2"]))
    saved = torch.load(Path(summary.last_checkpoint) / DRAFT_HISTORY_FILE, weights_only=True)
    # 2 prompts a step, one per actor, 2 responses each: 4 texts per actor after 2 steps.
    assert len(saved) == 2 and [len(state["texts"]) for state in saved] == [4, 4]
    assert all(len(tokens) > 3 for state in saved for _, _, tokens in state["texts"])

    held = {}
    resumed = run_training(config(tmp_path, ["total_steps=3"]),
                           on_step_end=lambda step, metrics, actors: held.update(
                               enumerate(k.draft_history for k in actors.decoder_checkpoints())))
    assert resumed.first_step == 2
    for before, after in zip(saved, (held[0], held[1])):
        assert after["texts"][:4] == before["texts"] and len(after["texts"]) == 6
        assert after["next_text"] == 6
