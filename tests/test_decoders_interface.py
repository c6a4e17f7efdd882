"""The decoder interface the rollout actor lives by (`decoders.RolloutDecoder`): every shipped
decoder implements it, the actor and evaluation ask a decoder nothing else and tell no modes
apart, and a decoder of a new kind, registered with the factory, works in the rollout actor."""
import ast
import inspect
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from specroll.actors import RolloutActor
from specroll.configs import load_train_config, sections
from specroll.configs.sections import RolloutSection
from specroll.data import load_problems
from specroll.decoders import DECODERS, RolloutDecoder, build_decoder, resumed_checkpoints
from specroll.eval.evaluation import eval_plan
from specroll.fastgrpo import FastGRPOConfig
from specroll.models.flat_weights import FlatWeights
from specroll.models.tiny import build_tiny_model
from specroll.rollout.decoder import Decoder, DecoderCheckpoint
from specroll.rollout.plain_decoder import PlainDecoder
from specroll.speculation import SpeculationConfig

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specroll"
INTERFACE = {name for cls in (Decoder, RolloutDecoder) for name in vars(cls) if not name.startswith("_")}
SHIPPED = {"vanilla": RolloutSection(mode="vanilla"),
           "speculation": RolloutSection(mode="speculation", speculation=SpeculationConfig(heads_path=None, budget="fixed")),
           "fastgrpo": RolloutSection(mode="fastgrpo", fastgrpo=FastGRPOConfig(drafter_path=None, capacity=32))}


@pytest.mark.parametrize("mode", sorted(SHIPPED))
def test_every_shipped_decoder_implements_the_rollout_interface(mode):
    decoder = build_decoder(build_tiny_model(seed=0), SHIPPED[mode])
    for name in sorted(INTERFACE):
        assert hasattr(decoder, name), f"{type(decoder).__name__} lacks RolloutDecoder.{name}"
        wanted = getattr(RolloutDecoder, name)
        if inspect.isfunction(wanted):
            assert list(inspect.signature(getattr(decoder, name)).parameters) == \
                list(inspect.signature(wanted).parameters)[1:], name
    state = decoder.checkpoint_state()
    assert isinstance(state, DecoderCheckpoint)
    decoder.load_checkpoint_state(state)
    assert (decoder.heads_version is None) == (decoder.heads_state() is None) == (mode != "speculation")


def test_the_speculative_decoder_loads_newer_heads_and_keeps_them_over_older():
    decoder = build_decoder(build_tiny_model(seed=0), SHIPPED["speculation"])
    held = decoder.heads_state()
    newer = replace(held, version=held.version + 2, state={k: v + 0.01 for k, v in held.state.items()})
    assert decoder.load_heads(newer) == decoder.heads_version == held.version + 2
    assert decoder.load_heads(replace(held, version=held.version + 1)) == held.version + 2
    assert all(torch.equal(decoder.heads_state().state[k], newer.state[k]) for k in newer.state)
    with pytest.raises(ValueError, match="PlainDecoder drafts with no horizon heads"):
        build_decoder(build_tiny_model(seed=0), SHIPPED["vanilla"]).load_heads(held)


def test_a_checkpoints_heads_replace_the_configured_ones_where_a_decoder_has_heads(tmp_path):
    """As evaluation builds its decoder: the configured heads file is not even looked for."""
    model = build_tiny_model(seed=0)
    held = build_decoder(model, SHIPPED["speculation"]).heads_state()
    saved = replace(held, version=7, state={k: v + 0.01 for k, v in held.state.items()})
    spec = replace(SHIPPED["speculation"].speculation, heads_path=str(tmp_path / "absent.safetensors"))
    decoder = build_decoder(model, replace(SHIPPED["speculation"], speculation=spec), heads=saved)
    assert decoder.heads_version == 7
    assert all(torch.equal(decoder.heads_state().state[k], saved.state[k]) for k in saved.state)
    assert build_decoder(model, SHIPPED["vanilla"], heads=saved).heads_version is None


def decoder_attributes(path: Path) -> set[str]:
    """The attributes read on a decoder in `path`: `self.decoder.x`, `engine.decoder.x`, `self.engine.decoder.x`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "decoder":
            found.add(node.attr)
    return found


def test_the_rollout_actor_and_evaluation_ask_a_decoder_nothing_beyond_the_interface():
    for path in (PACKAGE / "actors" / "rollout_actor.py", PACKAGE / "eval" / "evaluation.py"):
        asked = decoder_attributes(path)
        assert asked and asked <= INTERFACE, f"{path.name} asks {sorted(asked - INTERFACE)} beyond RolloutDecoder"


def test_only_the_factory_tells_rollout_modes_apart():
    """No mode checks in the rollout actor, the driver or evaluation, and no remote call named by a string."""
    mode_check = re.compile(r"\.mode\s*(==|!=|in\b)|\.speculates\b")
    by_name = re.compile(r"getattr\((actor|self\.\w+|engine)")
    for path in [*(PACKAGE / "actors").glob("*.py"), PACKAGE / "train.py", *(PACKAGE / "eval").glob("*.py")]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not mode_check.search(line), f"{path.name}:{number} checks the rollout mode: {line.strip()}"
            assert not by_name.search(line), f"{path.name}:{number} calls by name: {line.strip()}"


def test_a_checkpoint_of_as_many_actors_resumes_each_its_own_and_of_another_count_shares():
    drafters, histories = [{"d": 0}, {"d": 1}], [{"next_text": 1, "texts": [["a", 0, [1]]]},
                                                 {"next_text": 1, "texts": [["b", 0, [2]]]}]
    assert resumed_checkpoints(None, None, 2) is None
    assert resumed_checkpoints(drafters, histories, 2) == [DecoderCheckpoint({"d": 0}, histories[0]),
                                                           DecoderCheckpoint({"d": 1}, histories[1])]
    merged = {"next_text": 2, "texts": [["a", 0, [1]], ["b", 1, [2]]]}
    assert resumed_checkpoints(drafters, histories, 3) == [DecoderCheckpoint({"d": 0}, merged)] * 3
    assert resumed_checkpoints(drafters, None, 1) == [DecoderCheckpoint({"d": 0}, None)]


class RememberingDecoder(PlainDecoder):
    """A decoder of a new kind, written for this test alone: plain steps, and it keeps every
    training response it learns from, which a checkpoint saves."""

    def __init__(self, model, compile: bool) -> None:
        super().__init__(model, compile)
        self.seen: list[list[int]] = []

    def learn_from_responses(self, prompts, responses, group_size) -> None:
        self.seen += [list(response) for response in responses]

    def checkpoint_state(self) -> DecoderCheckpoint:
        return DecoderCheckpoint(draft_history={"seen": [list(r) for r in self.seen]})

    def load_checkpoint_state(self, state: DecoderCheckpoint) -> None:
        self.seen = [list(r) for r in state.draft_history["seen"]]


def test_a_decoder_of_a_new_mode_works_in_the_rollout_actor(monkeypatch):
    """In-process (no Ray): registered with the factory alone, it generates, learns and resumes in the actor."""
    monkeypatch.setitem(DECODERS, "remembering", lambda model, rollout, seed, heads: RememberingDecoder(model, False))
    monkeypatch.setattr(sections, "ROLLOUT_MODES", (*sections.ROLLOUT_MODES, "remembering"))
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = load_train_config(compose("config", overrides=["experiment=smoke", "rollout.mode=remembering"]))
    actor = RolloutActor(cfg, index=0)
    actor.load_policy(0, FlatWeights.pack(actor.model.state_dict()))
    problems = load_problems("synthetic", synthetic=cfg.data.synthetic)[:2]
    out = actor.generate(0, 0, list(enumerate(problems)))
    assert out.head_version is None and out.head_records == [] and out.drafter_updates == []
    assert actor.versions().heads is None and actor.heads_state() is None
    kept = actor.decoder_checkpoint()
    assert kept.draft_history["seen"] == out.response_ids and len(out.response_ids) == 2 * cfg.rollout.n
    actor.evaluate(list(enumerate(problems)), eval_plan(cfg.rollout, cfg.eval))
    assert actor.decoder_checkpoint() == kept  # evaluation teaches a decoder nothing
    fresh = RolloutActor(cfg, index=1)
    fresh.load_decoder_checkpoint(kept)
    assert fresh.decoder_checkpoint() == kept
