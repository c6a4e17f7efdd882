"""The whole training run's config, and loading it from Hydra with fail-fast validation.

Three stages, each raising `ValueError` that names the dotted field (`FieldError` for a value):
`load_train_config` checks types, unknown keys, each section's fields, the rules across
sections and the files the config points to; `validate_against_model` adds the limits that
only the model knows (its context length).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from specroll.config_checks import FieldError, check_int, check_seed, check_text, names_local_file, not_found, require
from specroll.data import DATA_SUFFIXES, split_file
from specroll.learner import MIN_KEEP_LAST, LearnerConfig
from specroll.models import ModelConfig
from specroll.telemetry.config import LoggerConfig

from .resume_changes import check_allow_list
from .sections import ClusterConfig, DataConfig, DynamicSamplingConfig, EvalConfig, RolloutConfig
from .typed import build_dataclass

RESUME_MODES = ("auto", "never")
MODEL_CACHE = "model_cache"  # under run_dir, unless model.cache_dir names another folder


@dataclass
class TrainConfig:
    """A GRPO training run: what is trained on what, how, where, and how it is recorded."""

    model: ModelConfig = field(default_factory=ModelConfig)  # the policy's weights
    data: DataConfig = field(default_factory=DataConfig)  # problems, batch of prompts, reward
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # sampling and speculative decoding
    learner: LearnerConfig = field(default_factory=LearnerConfig)  # DeepSpeed, optimiser, GRPO loss
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # Ray actors and their resources
    logger: LoggerConfig = field(default_factory=LoggerConfig)  # W&B, JSONL, console
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out problems and pass@k sampling
    # DAPO's dynamic sampling: groups without reward signal replaced by new ones within the step
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    seed: int = 0  # seeds prompt order, sampling and (through conf/) the learner's shuffling
    total_steps: int = 200  # training steps: rollout, reward, update, weight sync
    checkpoint_every: int = 50  # save a checkpoint every this many steps; 0 never saves
    # evaluate the policy on the held-out problems (`eval`) every this many steps and after the last; 0 never
    eval_every: int = 0
    keep_last: int = 3  # complete checkpoints kept (>= 2: one to fall back to); older ones are deleted
    resume: str = "auto"  # auto: newest checkpoint in run_dir if any; never: start fresh; or a checkpoint path
    # fields (or sections) a resume may change that change the run (learner.lr, seed, data, ...): see
    # specroll/configs/resume_changes.py; others of that kind are refused naming both values
    resume_allow_changes: list[str] = field(default_factory=list)
    run_dir: str = "runs/default"  # checkpoints, metrics.jsonl and wandb/ go here; relative to the launch directory

    def __post_init__(self) -> None:
        check_seed("seed", self.seed)
        check_int("total_steps", self.total_steps, 1)
        check_int("checkpoint_every", self.checkpoint_every, 0)
        check_int("keep_last", self.keep_last, MIN_KEEP_LAST)
        check_int("eval_every", self.eval_every, 0)
        require(isinstance(self.resume, str) and self.resume, "resume", self.resume, "'auto', 'never' or a checkpoint path")
        check_allow_list(self.resume_allow_changes)
        check_text("run_dir", self.run_dir)
        self.check_sections_agree()

    def check_sections_agree(self) -> None:
        rollout, learner, data, cluster = self.rollout, self.learner, self.data, self.cluster
        require(rollout.max_new_tokens <= learner.max_response_len, "rollout.max_new_tokens", rollout.max_new_tokens,
                f"<= learner.max_response_len ({learner.max_response_len})", why="the learner refuses longer responses")
        require(learner.temperature == rollout.temperature, "learner.temperature", learner.temperature,
                f"rollout.temperature ({rollout.temperature})",
                why="the learner scores responses under the distribution they were sampled from")
        require(data.prompts_per_step % cluster.learner_world_size == 0, "data.prompts_per_step", data.prompts_per_step,
                f"a multiple of cluster.learner_world_size ({cluster.learner_world_size})",
                why="every learner rank takes the same number of whole groups")
        require(cluster.num_rollout_actors <= data.prompts_per_step, "cluster.num_rollout_actors",
                cluster.num_rollout_actors, f"<= data.prompts_per_step ({data.prompts_per_step})",
                why="each rollout actor needs at least one prompt")
        ranks = cluster.learner_world_size
        require(self.target_groups % ranks == 0, "dynamic_sampling.target_groups", self.dynamic_sampling.target_groups,
                f"a multiple of cluster.learner_world_size ({ranks})", why="every learner rank takes the same number of whole groups")

    @property
    def target_groups(self) -> int:
        """The groups a step trains on: dynamic_sampling.target_groups, else data.prompts_per_step."""
        return self.dynamic_sampling.target_groups or self.data.prompts_per_step

    @property
    def model_cache(self) -> Path:
        """Where the driver stages the model for every actor: model.cache_dir, else <run_dir>/model_cache."""
        return Path(self.model.cache_dir) if self.model.cache_dir else Path(self.run_dir) / MODEL_CACHE

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (for W&B and the checkpoint's record of the run)."""
        return to_plain(asdict(self))


def to_plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return value


def load_train_config(cfg: DictConfig | dict) -> TrainConfig:
    """The validated `TrainConfig` of a composed Hydra config (or a plain dict of the same shape).

    Interpolations are resolved; keys left out take the dataclass defaults.
    Raises `ValueError` naming the dotted field for an unknown key, a wrong type, a missing
    (`???`) value, an invalid value, sections that disagree, or a file that does not exist.
    """
    if isinstance(cfg, DictConfig):
        try:
            values = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        except OmegaConfBaseException as exc:
            # OmegaConf appends "full_key: ..." lines to its message; the first line says it all.
            raise ValueError(f"{exc.full_key}: {exc.msg.splitlines()[0]}") from exc
    else:
        values = cfg
    train = build_dataclass(TrainConfig, values)
    check_paths(train)
    return train




def check_paths(cfg: TrainConfig) -> None:
    """Files and folders the config names must exist (paths relative to the working directory)."""
    for field_name in ("name", "tokenizer"):
        try:
            cfg.model.check_files(field_name)
        except FieldError as exc:
            raise exc.within("model") from exc
    data = cfg.data
    if data.name != "synthetic" and data.path is not None:
        check_problems_at("data.path", data.path, data.split, "data.split")
    if cfg.eval_every:
        check_held_out(cfg)
    for mode, where, path in (("speculation", "rollout.speculation.heads_path", cfg.rollout.speculation.heads_path),
                              ("fastgrpo", "rollout.fastgrpo.drafter_path", cfg.rollout.fastgrpo.drafter_path)):
        if cfg.rollout.mode == mode and path not in (None, "shipped"):
            require(Path(path).expanduser().is_file(), where, path, "null, 'shipped' or an existing file",
                    why=not_found(path))
    require(cfg.resume in RESUME_MODES or Path(cfg.resume).expanduser().is_dir(), "resume", cfg.resume,
            "'auto', 'never' or a checkpoint folder", why=not_found(cfg.resume))


def check_problems_at(where: str, path: str, split: str, split_field: str) -> None:
    """A problem file must exist (a dataset name need not), and a folder must hold the split."""
    local = Path(path).expanduser()
    if local.is_dir():
        require(split_file(local, split) is not None, where, path, f"a folder holding a {split} file ({split_field})",
                why=f"{local} has no {split}.jsonl, nor a .json, .parquet or .arrow file of that split")
    else:
        require(not names_local_file(path, DATA_SUFFIXES) or local.is_file(), where, path,
                "an existing file, a folder or a hub dataset name", why=not_found(path))


def check_held_out(cfg: TrainConfig) -> None:
    """The held-out problems must exist and differ from the training file."""
    data, held_out = cfg.data, cfg.eval
    if held_out.path is not None:
        check_problems_at("eval.path", held_out.path, held_out.split, "eval.split")
        return
    if data.name == "synthetic" or data.path is None:
        return
    local = Path(data.path).expanduser()
    require(not local.is_file(), "eval.path", held_out.path, "a file of held-out problems",
            why=f"data.path {local} is one file, the training problems; or give data.path as a folder of <split> files")
    require(not local.is_dir() or split_file(local, held_out.split) is not None, "eval.split", held_out.split,
            f"a split of data.path's folder {local}, or eval.path set", why=f"{local} has no {held_out.split} file")


def validate_against_model(cfg: TrainConfig, context: int) -> None:
    """Limits that need the model's context window (`context` tokens): every sequence must fit in it."""
    where = f"the context of model.name {cfg.model.name!r} ({context} tokens)"
    rollout = cfg.rollout
    if rollout.mode != "vanilla":
        field_name = "rollout.speculation.max_nodes" if rollout.mode == "speculation" else "rollout.fastgrpo.max_nodes"
        require(rollout.max_new_tokens + rollout.max_tokens_per_step <= context, "rollout.max_new_tokens",
                rollout.max_new_tokens, f"<= {context - rollout.max_tokens_per_step}",
                why=f"it + {field_name} ({rollout.max_tokens_per_step}) must fit in {where}")
    else:
        require(rollout.max_new_tokens < context, "rollout.max_new_tokens", rollout.max_new_tokens, f"< {context}",
                why=f"a prompt needs room in {where}")
    require(cfg.learner.max_seq_len <= context, "learner.max_seq_len", cfg.learner.max_seq_len, f"<= {context}",
            why=f"a sequence must fit in {where}")
