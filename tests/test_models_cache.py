"""One model download per cluster: the driver stages the model once into the run's cache
(`specroll.models.model_cache`), every Ray actor loads from there, and an actor that cannot
read it fails with one message naming the entry. No network: a tiny model written as a local
Hugging Face directory stands for the downloaded or converted one."""
import json
import shutil
from pathlib import Path

import pytest
import ray
from hydra import compose, initialize_config_dir

from specroll.actors import ActorFailedError, LearnerActor, RolloutActor, RunActors, as_remote, gather
from specroll.configs import ModelConfig, load_train_config
from specroll.learner import export_hf
from specroll.models.model_cache import MANIFEST, ModelCacheError, entry_dir, stage, staged

CONF = Path(__file__).resolve().parents[1] / "conf"
RAY_CPUS = 2


@pytest.fixture
def tiny_hf_dir(tmp_path):
    """A tiny random Llama with SmolLM2's tokenizer, as a Hugging Face directory."""
    model, tokenizer = ModelConfig(name="tiny-llama", tokenizer="smollm2-135m-instruct").load(seed=0)
    return export_hf(model, model.config, tokenizer, tmp_path / "source")


def config(tmp_path, model_dir):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return load_train_config(compose("config", overrides=[
            "experiment=smoke", f"run_dir={tmp_path / 'run'}", f"model.name={model_dir}", "model.tokenizer=null",
            "model.device=cpu", "learner.device=cpu", "rollout=vanilla", "logger.console=false"]))


def test_a_staged_entry_holds_the_files_loading_reads_and_is_reused_while_its_source_is_unchanged(tiny_hf_dir, tmp_path):
    cache = tmp_path / "cache"
    (tiny_hf_dir / "chat_template.jinja").write_text("{{ messages }}")  # where transformers keeps a chat template
    entry = stage(str(tiny_hf_dir), cache)
    assert entry == entry_dir(str(tiny_hf_dir), cache) and entry.parent == cache
    staged_names = sorted(p.name for p in entry.iterdir())
    assert MANIFEST in staged_names and "model.safetensors" in staged_names and "tokenizer.json" in staged_names
    assert "chat_template.jinja" in staged_names  # else actors prompt without the template the driver used
    assert (entry / "model.safetensors").stat().st_ino == (tiny_hf_dir / "model.safetensors").stat().st_ino  # linked
    manifest = (entry / MANIFEST).stat().st_mtime_ns
    assert stage(str(tiny_hf_dir), cache) == entry and (entry / MANIFEST).stat().st_mtime_ns == manifest
    (tiny_hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))  # the source changes
    stage(str(tiny_hf_dir), cache)
    assert json.loads((entry / "generation_config.json").read_text()) == {"eos_token_id": [2, 3]}
    assert staged(str(tiny_hf_dir), cache) == entry


def test_a_tiny_models_tokenizer_is_staged_without_weights(tiny_hf_dir, tmp_path):
    cache, section = tmp_path / "cache", ModelConfig(name="tiny-llama", tokenizer=str(tiny_hf_dir), device="cpu")
    section.stage(cache)
    entry = entry_dir(str(tiny_hf_dir), cache, weights=False)
    assert (entry / "tokenizer.json").is_file() and not list(entry.glob("*.safetensors"))
    assert section.load_tokenizer(cache).name_or_path == str(entry)


def test_a_hub_models_intact_entry_is_used_without_asking_the_hub(tiny_hf_dir, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(stage(str(tiny_hf_dir), cache), entry_dir("acme/tiny-policy", cache))
    assert stage("acme/tiny-policy", cache) == entry_dir("acme/tiny-policy", cache)  # no network here
    model, tokenizer = ModelConfig(name="acme/tiny-policy", device="cpu").load(cache=cache)
    assert model.config.name == "acme/tiny-policy" and tokenizer.name_or_path == str(entry_dir("acme/tiny-policy", cache))


def test_an_entry_that_cannot_be_read_is_named_in_one_message(tiny_hf_dir, tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(ModelCacheError) as missing:
        staged(str(tiny_hf_dir), cache)
    entry = entry_dir(str(tiny_hf_dir), cache)
    assert str(missing.value).startswith(f"cannot read the staged model {entry}: it holds no {MANIFEST}")
    stage(str(tiny_hf_dir), cache)
    weights = entry / "model.safetensors"
    weights.unlink()
    weights.write_bytes(b"cut short")
    with pytest.raises(ModelCacheError, match=f"{entry}: model.safetensors holds 9 bytes"):
        staged(str(tiny_hf_dir), cache)


def test_ray_actors_load_the_drivers_staged_copy_and_one_that_cannot_read_it_fails_naming_it(
        ray_cluster, tiny_hf_dir, tmp_path):
    cfg = config(tmp_path, tiny_hf_dir)
    entry = entry_dir(cfg.model.name, cfg.model_cache)
    actors = RunActors.start(cfg)  # stages the model, then starts the actors
    try:
        loaded = actors.rollout[0].__ray_call__.remote(lambda self: self.tokenizer.name_or_path)
        assert actors.wait([("rollout actor 0", loaded)], "tokenizer source") == [str(entry)]
    finally:
        actors.shutdown()
    assert entry.parent == tmp_path / "run" / "model_cache"
    (entry / "model.safetensors").unlink()  # as a node that does not see the driver's storage would find it
    rollout = as_remote(RolloutActor, 1).remote(cfg, 0)
    learner = as_remote(LearnerActor, 1).remote(cfg, 0, 1)
    for name, call in (("rollout actor 0", rollout.versions.remote()), ("learner rank 0", learner.setup.remote("", 0))):
        with pytest.raises(ActorFailedError) as failed:
            gather([(name, call)], "start-up", 120)
        message = str(failed.value)
        assert f"cannot read the staged model {entry}: model.safetensors is unreadable" in message, message
        assert message.count(str(entry)) == 1
    ray.kill(learner)
