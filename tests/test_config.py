"""The Hydra tree in conf/ and the typed TrainConfig it loads into: defaults, overrides, fail-fast errors."""
import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from specroll.configs import ModelConfig, TrainConfig, load_train_config, validate_against_model
from specroll.decoders import build_decoder
from specroll.fastgrpo import FastGRPOConfig, FastGRPODecoder, OnlineConfig
from specroll.learner import LearnerConfig
from specroll.models import build_tiny_model, tiny_config
from specroll.rollout import PlainDecoder, RolloutEngine, SamplingParams
from specroll.speculation import SpeculationConfig, SpeculativeDecoder
from specroll.speculation.config import ADAPTATION_MODES

CONF = Path(__file__).resolve().parents[1] / "conf"
SHARED_GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def composed(overrides: list[str] = ()):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=list(overrides))


def load(overrides: list[str] = ()) -> TrainConfig:
    return load_train_config(composed(overrides))


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_default_composition_is_exactly_the_dataclass_defaults():
    cfg = composed()
    assert load_train_config(cfg) == TrainConfig()
    # The YAML mirrors every field, so a user sees every knob where the defaults live; the
    # FastGRPO baseline's knobs live in rollout/fastgrpo.yaml, mirrored there in full.
    expected = TrainConfig().to_dict()
    fastgrpo = expected["rollout"].pop("fastgrpo")
    assert OmegaConf.to_container(cfg, resolve=True) == expected
    assert OmegaConf.to_container(composed(["rollout=fastgrpo"]), resolve=True)["rollout"]["fastgrpo"] == fastgrpo


@pytest.mark.parametrize(
    "group, option",
    [(g, o) for g in ("model", "data", "rollout", "learner", "cluster", "logger", "experiment") for o in group_options(g)],
)
def test_every_group_option_composes_and_validates(group, option):
    cfg = load([f"{group}={option}"])
    assert isinstance(cfg, TrainConfig)


def test_command_line_overrides_reach_the_dataclasses():
    cfg = load(["rollout=vanilla", "rollout.max_new_tokens=64", "cluster.num_rollout_actors=2"])
    assert cfg.rollout.mode == "vanilla" and not cfg.rollout.speculates
    assert cfg.rollout.max_new_tokens == 64
    assert cfg.cluster.num_rollout_actors == 2
    params = cfg.rollout.sampling_params(seed=3)
    assert (params.max_new_tokens, params.n, params.seed) == (64, 8, 3)
    assert load().rollout.speculates and load().rollout.speculation == SpeculationConfig()


@pytest.mark.parametrize("adaptation", ADAPTATION_MODES)
def test_rollout_modes_and_adaptations_switch_by_override(adaptation):
    """What the comparison command races: rollout=vanilla | fastgrpo | specroll with each adaptation."""
    fast = load(["rollout=fastgrpo", "rollout.fastgrpo.capacity=32", "rollout.fastgrpo.online.enabled=false"])
    assert fast.rollout.mode == "fastgrpo" and not fast.rollout.speculates
    assert fast.rollout.fastgrpo == FastGRPOConfig(capacity=32, online=OnlineConfig(enabled=False))
    assert fast.rollout.max_tokens_per_step == 32
    spec = load([f"rollout.speculation.adaptation={adaptation}"])
    assert spec.rollout.mode == "speculation" and spec.rollout.speculation.adaptation == adaptation
    assert load(["rollout=vanilla"]).rollout.mode == "vanilla"


def test_each_rollout_mode_builds_its_decoder():
    """`build_decoder` gives the mode's decoder, on its own config section, and each one decodes."""
    model = build_tiny_model(seed=0)
    overrides = {"vanilla": [],
                 "speculation": ["rollout.speculation.heads_path=null", "rollout.speculation.budget=fixed"],
                 "fastgrpo": ["rollout.fastgrpo.drafter_path=null", "rollout.fastgrpo.capacity=32"]}
    kinds = {"vanilla": PlainDecoder, "speculation": SpeculativeDecoder, "fastgrpo": FastGRPODecoder}
    for mode, kind in kinds.items():
        rollout = load([f"rollout={mode}", *overrides[mode]]).rollout
        decoder = build_decoder(model, rollout)
        assert type(decoder) is kind and not decoder.compiled
        assert decoder.max_tokens_per_step == rollout.max_tokens_per_step
        out = RolloutEngine(model, decoder=decoder).generate([[3, 4, 5]], SamplingParams(max_new_tokens=6, n=2))
        assert (out.stats.tree is None) == (mode == "vanilla")


def test_learner_follows_the_rollout_temperature_and_the_run_seed():
    cfg = load(["rollout.temperature=0.7", "seed=5"])
    assert cfg.learner.temperature == 0.7 and cfg.learner.seed == 5


def test_experiments_override_groups_and_top_level_values():
    smoke = load(["experiment=smoke"])
    assert smoke.model.name == "tiny-llama" and smoke.logger.backend == "none"
    assert (smoke.total_steps, smoke.rollout.max_new_tokens, smoke.rollout.speculation.max_nodes) == (2, 16, 4)
    paper = load(["experiment=paper_gsm8k_qwen2_5_1_5b"])
    assert paper.model.name == "Qwen/Qwen2.5-1.5B-Instruct" and paper.model.dtype == "bfloat16"
    assert (paper.data.name, paper.learner.dtype, paper.cluster.learner_world_size) == ("gsm8k", "bfloat16", 4)


def test_activation_checkpointing_is_off_on_cpus_and_on_in_the_gpu_preset():
    assert not load().learner.activation_checkpointing
    assert load(["learner.activation_checkpointing=true"]).learner.activation_checkpointing
    assert load(["experiment=paper_gsm8k_qwen2_5_1_5b"]).learner.activation_checkpointing
    assert not load(["experiment=paper_gsm8k_qwen2_5_1_5b", "learner.activation_checkpointing=false"]).learner.activation_checkpointing


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["cluster.num_rollout_actors=-1"], "cluster.num_rollout_actors must be an int >= 1, got -1"),
        (["data.prompts_per_step=0"], "data.prompts_per_step must be an int >= 1"),
        (["data.long_prompts=truncate"], "data.long_prompts must be one of 'fail', 'drop', got 'truncate'"),
        (["keep_last=1"], "keep_last must be an int >= 2, got 1"),
        (["rollout.max_new_tokens=-5"], "rollout.max_new_tokens must be an int >= 1, got -5"),
        (["learner.micro_batch_tokens=-1"], "learner.micro_batch_tokens must be an int >= 1"),
        (["cluster.remote_timeout_s=0"], "cluster.remote_timeout_s must be a finite number > 0"),
        (["rollout.speculation.min_nodes=32"], "rollout.speculation.max_nodes must be an int >= 32, got 16: min_nodes is the least a step drafts"),
        (["learner.zero_stage=4"], "learner.zero_stage must be one of 0, 1, 2, 3, got 4"),
        (["learner.activation_checkpointing=sometimes"], "learner.activation_checkpointing must be a bool, got 'sometimes'"),
        (["learner.loss.clip_low=1.5"], "learner.loss.clip_low must be a finite number in [0, 1), got 1.5"),
        (["learner.loss.kl_estimator=k9"], "learner.loss.kl_estimator must be one of 'k1', 'k2', 'k3'"),
        (["learner/loss=cispo", "learner.loss.aggregation=seq-mean-token-mean"],
         "learner.loss.aggregation must be 'token-mean' with surrogate 'cispo', got 'seq-mean-token-mean': CISPO normalises by tokens, as in TRL"),
        (["learner.loss.mismatch_correction=token_truncate", "learner.loss.mismatch_weight_max=null"],
         "learner.loss.mismatch_weight_max must be a bound (or mismatch_weight_min one) with mismatch_correction 'token_truncate', got None: an unbounded weight truncates nothing"),
        (["learner.overlong_buffer_len=4"], "learner.overlong_buffer_len must be 0 while overlong_max_len is null, got 4"),
        (["data.synthetic.max_steps=1"], "data.synthetic.max_steps must be an int >= 2, got 1"),
        (["data.reward.format_weight=-1"], "data.reward.format_weight must be a finite number >= 0, got -1.0"),
        (["data=math", "data.reward.function=number"],
         "data.reward.function must be math_verify, got 'number': number compares numbers, but records.answer_format 'boxed' gives LaTeX answers"),
        (["data=math", "data.reward.function=exact"], "data.reward.function must be one of 'number', 'math_verify'"),
        (["data=math", "data.reward.timeout_s=0"], "data.reward.timeout_s must be a finite number > 0, got 0.0"),
        (["data=math", "data.records.answer_format=latex"], "data.records.answer_format must be one of 'number'"),
        (["data=math", "data.records.levels=[three]"], "data.records.levels[0] must be an int, got 'three'"),
        (["data.name=my_set"], "data.path must be a file, a folder or a hub dataset name for problem set 'my_set'"),
        (["data=math", "data.path=/nonexistent/math.parquet"], "data.path must be an existing file, a folder or a hub dataset name, got '/nonexistent/math.parquet': not found"),
        (["learner.lr=abc"], "learner.lr must be a number, got 'abc'"),
        (["rollout.n=1"], "rollout.n must be an int >= 2, got 1: GRPO advantages compare the responses to one prompt"),
        (["rollout.n=0"], "rollout.n must be an int >= 2, got 0: GRPO advantages compare the responses to one prompt"),
        (["rollout.temperature=nan"], "rollout.temperature must be a finite number > 0"),
        (["rollout.sync_every=0"], "rollout.sync_every must be an int >= 1, got 0"),
        (["rollout.temperature=0"], "rollout.temperature must be a finite number > 0, got 0.0: a greedy group's responses are all alike, so GRPO learns nothing"),
        (["rollout.mode=turbo"], "rollout.mode must be one of 'vanilla', 'speculation', 'fastgrpo'"),
        (["rollout=fastgrpo", "rollout.fastgrpo.online.lr=0"], "rollout.fastgrpo.online.lr must be a finite number > 0, got 0.0"),
        (["rollout=fastgrpo", "rollout.fastgrpo.max_nodes=1"], "rollout.fastgrpo.max_nodes must be an int >= 2, got 1: the root and one draft"),
        (["rollout.speculation.adaptation=sometimes"], "rollout.speculation.adaptation must be one of"),
        (["rollout.speculation.sync_free_trees=sometimes"], "rollout.speculation.sync_free_trees must be"),
        (["rollout.speculation.max_depth=5"],
         "rollout.speculation.max_depth must be null or <= the heads' depth (4), got 5: no draft source reaches past the last head yet"),
        (["model.dtype=int8"], "model.dtype must be one of"),
        (["model.name=tiny-gpt2"], "model.name must be one of tiny-llama, tiny-qwen2, tiny-qwen3 for a tiny model, got 'tiny-gpt2'"),
        (["model.tokenizer=smollm2-135m-instruct"], "model.tokenizer must be null for 'smollm2-135m-instruct', got 'smollm2-135m-instruct': only tiny-* models take a tokenizer; others bring their own"),
        (["logger.mode=cloud"], "logger.mode must be one of 'offline', 'online', 'disabled'"),
        (["cluster.gpus_per_learner=1.5"], "cluster.gpus_per_learner must be a fraction up to 1 or a whole number, got 1.5: Ray's rule"),
        (["cluster.weight_sync=ray"], "cluster.weight_sync must be one of 'collective', 'object_store', got 'ray'"),
        (["cluster.weight_sync_bucket_mb=0"], "cluster.weight_sync_bucket_mb must be a finite number > 0"),
        (["+cluster.rollout_resources.rollout_node=0"], "cluster.rollout_resources.rollout_node must be a finite number > 0"),
        (["+cluster.learner_resources.GPU=1"], "cluster.learner_resources must be a mapping of custom resource names to amounts, got {'GPU': 1}: 'GPU' is no custom resource (CPUs and GPUs have cpus_* / gpus_* fields)"),
        (["learner.temperature=0.5"], "learner.temperature must be rollout.temperature (1.0), got 0.5: the learner scores responses under the distribution they were sampled from"),
        (["rollout.max_new_tokens=1024"], "rollout.max_new_tokens must be <= learner.max_response_len (512), got 1024: the learner refuses longer responses"),
        (["cluster.learner_world_size=3"], "data.prompts_per_step must be a multiple of cluster.learner_world_size (3), got 8: every learner rank takes the same number of whole groups"),
        (["cluster.num_rollout_actors=9"], "cluster.num_rollout_actors must be <= data.prompts_per_step (8), got 9: each rollout actor needs at least one prompt"),
        (["dynamic_sampling.at_cap=error"], "dynamic_sampling.at_cap must be one of 'train', 'skip', got 'error'"),
        (["dynamic_sampling.max_extra_rounds=-1"], "dynamic_sampling.max_extra_rounds must be an int >= 0, got -1"),
        (["dynamic_sampling.round_prompts=0"], "dynamic_sampling.round_prompts must be an int >= 1, got 0"),
        (["cluster.learner_world_size=2", "dynamic_sampling.target_groups=3"],
         "dynamic_sampling.target_groups must be a multiple of cluster.learner_world_size (2), got 3: every learner rank takes the same number of whole groups"),
        (["total_steps=???"], "total_steps: Missing mandatory value"),
        (["+rollout.top_q=0.5"], "rollout.top_q: unknown key"),
        (["+learner.loss.bogus=1"], "learner.loss.bogus: unknown key"),
        (["+num_steps=3"], "num_steps: unknown key"),
        (["data=gsm8k", "data.path=/nonexistent/gsm8k/train.jsonl"], "data.path must be an existing file, a folder or a hub dataset name, got '/nonexistent/gsm8k/train.jsonl': not found"),
        (["rollout.speculation.heads_path=/nonexistent/heads.pt"], "rollout.speculation.heads_path must be null, 'shipped' or an existing file, got '/nonexistent/heads.pt': not found"),
        (["rollout=fastgrpo", "rollout.fastgrpo.drafter_path=/nonexistent/d.safetensors"],
         "rollout.fastgrpo.drafter_path must be null, 'shipped' or an existing file, got '/nonexistent/d.safetensors': not found"),
        (["model.name=/nonexistent/model.gguf"], "model.name must be an existing file, got '/nonexistent/model.gguf': not found"),
        (["model=tiny", "model.tokenizer=./nonexistent"], "model.tokenizer must be an existing file, got './nonexistent': nonexistent not found"),
        (["resume=/nonexistent/step_00000010"], "resume must be 'auto', 'never' or a checkpoint folder, got '/nonexistent/step_00000010': not found"),
    ],
)
def test_invalid_configs_fail_naming_the_field(overrides, message):
    with pytest.raises(ValueError) as info:
        load(overrides)
    assert message in str(info.value)


def test_unknown_group_option_and_unknown_key_fail_at_composition():
    with pytest.raises(MissingConfigException, match="rollout/turbo"):
        composed(["rollout=turbo"])
    # Hydra composes in struct mode: a new key needs "+", and then load_train_config refuses it.
    with pytest.raises(ConfigCompositionException, match="rollout.top_q"):
        composed(["rollout.top_q=0.5"])


def test_gsm8k_from_a_local_folder(tmp_path):
    if not SHARED_GSM8K.is_dir():
        pytest.skip(f"GSM8K not found at {SHARED_GSM8K}")
    cfg = load(["data=gsm8k", f"data.path={SHARED_GSM8K}", "data.split=test"])
    assert (cfg.data.name, cfg.data.path, cfg.data.split) == ("gsm8k", str(SHARED_GSM8K), "test")
    with pytest.raises(ValueError, match=r"data.path must be a folder holding a train file \(data.split\), got '.*': "
                                         r".* has no train.jsonl, nor a .json, .parquet or .arrow file of that split"):
        load(["data=gsm8k", f"data.path={tmp_path}"])


def test_plain_dicts_and_the_saved_form_round_trip():
    cfg = load(["experiment=smoke"])
    assert load_train_config(cfg.to_dict()) == cfg
    partial = load_train_config({"rollout": {"n": 4}, "learner": {"lr": 1e-5}})
    assert partial.rollout.n == 4 and partial.learner == LearnerConfig(lr=1e-5)
    with pytest.raises(ValueError, match="rollout must be a mapping of RolloutConfig fields"):
        load_train_config({"rollout": 3})


def test_context_limits_are_checked_against_the_model():
    tiny = ModelConfig(name="tiny-llama").context_length()  # 256 tokens, read without building the model
    assert tiny == tiny_config("llama").max_position_embeddings == 256
    validate_against_model(load(["experiment=smoke"]), tiny)
    context = "the context of model.name 'smollm2-135m-instruct' (256 tokens)"
    with pytest.raises(ValueError, match=re.escape(
            f"rollout.max_new_tokens must be <= 240, got 256: it + rollout.speculation.max_nodes (16) must fit in {context}")):
        validate_against_model(load(), tiny)
    with pytest.raises(ValueError, match=re.escape(
            f"rollout.max_new_tokens must be <= 96, got 256: it + rollout.fastgrpo.max_nodes (160) must fit in {context}")):
        validate_against_model(load(["rollout=fastgrpo"]), tiny)
    with pytest.raises(ValueError, match=re.escape(f"rollout.max_new_tokens must be < 256, got 256: a prompt needs room in {context}")):
        validate_against_model(load(["rollout=vanilla"]), tiny)
    with pytest.raises(ValueError, match=re.escape(f"learner.max_seq_len must be <= 256, got 1024: a sequence must fit in {context}")):
        validate_against_model(load(["rollout.max_new_tokens=128"]), tiny)


def test_tiny_model_section_builds_the_seeded_tiny_model():
    model, tokenizer = ModelConfig(name="tiny-qwen2", device="cpu").load(seed=3)
    assert tokenizer is None and model.config == tiny_config("qwen2")
    for got, want in zip(model.state_dict().values(), build_tiny_model("qwen2", seed=3).state_dict().values()):
        torch.testing.assert_close(got, want)


def test_tiny_model_with_a_tokenizer_takes_its_vocabulary():
    model, tokenizer = load(["experiment=smoke"]).model.load(seed=0)
    assert model.config.vocab_size == len(tokenizer) == 49152
    assert model.config.eos_token_ids == [tokenizer.eos_token_id]


def test_an_override_renamed_since_earlier_runs_is_named_with_its_new_spelling():
    from specroll.configs.renames import renamed_overrides
    from specroll.command_line import refuse_renamed

    assert renamed_overrides(["rollout.spec.budget=fixed", "+rollout.spec.x=1", "rollout=specroll",
                              "rollout.mode=specroll", "rollout=speculation", "rollout.speculation.budget=fixed",
                              "rollout=specroll_v2"]) == [
        "rollout.spec.budget=fixed -> rollout.speculation.budget=fixed",
        "+rollout.spec.x=1 -> +rollout.speculation.x=1",
        "rollout=specroll -> rollout=speculation",
        "rollout.mode=specroll -> rollout.mode=speculation"]
    with pytest.raises(SystemExit, match="rollout.spec.max_nodes=8 -> rollout.speculation.max_nodes=8"):
        refuse_renamed(["experiment=smoke", "rollout.spec.max_nodes=8"])
    refuse_renamed(["experiment=smoke", "rollout.speculation.max_nodes=8"])  # nothing renamed: no exit
