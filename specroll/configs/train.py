"""The whole training run's config, and loading it from Hydra with fail-fast validation.

Three stages, each raising `ValueError` that names the dotted field:
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

from specroll.data import DATA_SUFFIXES, split_file
from specroll.learner import MIN_KEEP_LAST, LearnerConfig
from specroll.models.loading import ALIASES, alias_path
from specroll.telemetry.config import LoggerSection

from .resume_changes import check_allow_list
from .sections import TINY_PREFIX, ClusterSection, DataSection, EvalSection, ModelSection, RolloutSection, check_int
from .typed import build_dataclass

RESUME_MODES = ("auto", "never")
MODEL_CACHE = "model_cache"  # under run_dir, unless model.cache_dir names another folder
# Local paths as `specroll.data.load_problem_set` tells them from dataset names.
_LOCAL_PREFIXES = ("/", ".", "~")


@dataclass
class TrainConfig:
    """A GRPO training run: what is trained on what, how, where, and how it is recorded."""

    model: ModelSection = field(default_factory=ModelSection)  # the policy's weights
    data: DataSection = field(default_factory=DataSection)  # problems, batch of prompts, reward
    rollout: RolloutSection = field(default_factory=RolloutSection)  # sampling and speculative decoding
    learner: LearnerConfig = field(default_factory=LearnerConfig)  # DeepSpeed, optimiser, GRPO loss
    cluster: ClusterSection = field(default_factory=ClusterSection)  # Ray actors and their resources
    logger: LoggerSection = field(default_factory=LoggerSection)  # W&B, JSONL, console
    eval: EvalSection = field(default_factory=EvalSection)  # held-out problems and pass@k sampling
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
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        check_int("total_steps", self.total_steps, 1)
        check_int("checkpoint_every", self.checkpoint_every, 0)
        check_int("keep_last", self.keep_last, MIN_KEEP_LAST)
        check_int("eval_every", self.eval_every, 0)
        if not self.resume:
            raise ValueError("resume must be 'auto', 'never' or a checkpoint path")
        check_allow_list(self.resume_allow_changes)
        if not self.run_dir:
            raise ValueError("run_dir must be a non-empty path")
        self.check_sections_agree()

    def check_sections_agree(self) -> None:
        rollout, learner, data, cluster = self.rollout, self.learner, self.data, self.cluster
        if rollout.max_new_tokens > learner.max_response_len:
            raise ValueError(
                f"rollout.max_new_tokens ({rollout.max_new_tokens}) must be <= learner.max_response_len "
                f"({learner.max_response_len}): the learner refuses longer responses"
            )
        if learner.temperature != rollout.temperature:
            raise ValueError(
                f"learner.temperature ({learner.temperature}) must equal rollout.temperature ({rollout.temperature}): "
                "the learner scores responses under the distribution they were sampled from"
            )
        if data.prompts_per_step % cluster.learner_world_size:
            raise ValueError(
                f"data.prompts_per_step ({data.prompts_per_step}) must be a multiple of cluster.learner_world_size "
                f"({cluster.learner_world_size}): every learner rank takes the same number of whole groups"
            )
        if cluster.num_rollout_actors > data.prompts_per_step:
            raise ValueError(
                f"cluster.num_rollout_actors ({cluster.num_rollout_actors}) must be <= data.prompts_per_step "
                f"({data.prompts_per_step}): each rollout actor needs at least one prompt"
            )

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


def looks_local(path: str, suffixes: tuple[str, ...]) -> bool:
    return path.startswith(_LOCAL_PREFIXES) or path.endswith(suffixes)


def check_paths(cfg: TrainConfig) -> None:
    """Files and folders the config names must exist (paths relative to the working directory)."""
    for where, name in (("model.name", cfg.model.name), ("model.tokenizer", cfg.model.tokenizer)):
        if name is None or name.startswith(TINY_PREFIX):
            continue
        if name in ALIASES:
            try:
                alias_path(name)
            except FileNotFoundError as exc:
                raise ValueError(f"{where}: {exc}") from exc
            continue
        local = Path(name).expanduser()
        if looks_local(name, (".gguf",)) and not local.exists():
            raise ValueError(f"{where}: file not found: {local}")
        if local.is_dir() and not (local / "config.json").is_file():
            raise ValueError(f"{where}: {local} is not a Hugging Face model directory (no config.json)")
    data = cfg.data
    if data.name != "synthetic" and data.path is not None:
        local = Path(data.path).expanduser()
        if local.is_dir():
            if split_file(local, data.split) is None:
                raise ValueError(f"data.path: folder {local} has no {data.split}.jsonl (data.split), "
                                 "nor a .json, .parquet or .arrow file of that split")
        elif looks_local(data.path, DATA_SUFFIXES) and not local.is_file():
            raise ValueError(f"data.path: file not found: {local}")
    if cfg.eval_every:
        check_held_out(cfg)
    heads = cfg.rollout.speculation.heads_path
    if cfg.rollout.mode == "speculation" and heads not in (None, "shipped") and not Path(heads).expanduser().is_file():
        raise ValueError(f"rollout.speculation.heads_path: file not found: {Path(heads).expanduser()}")
    drafter = cfg.rollout.fastgrpo.drafter_path
    if cfg.rollout.mode == "fastgrpo" and drafter not in (None, "shipped") and not Path(drafter).expanduser().is_file():
        raise ValueError(f"rollout.fastgrpo.drafter_path: file not found: {Path(drafter).expanduser()}")
    if cfg.resume not in RESUME_MODES and not Path(cfg.resume).expanduser().is_dir():
        raise ValueError(f"resume: checkpoint not found: {Path(cfg.resume).expanduser()} (or use 'auto' / 'never')")


def check_held_out(cfg: TrainConfig) -> None:
    """The held-out problems must exist and differ from the training file."""
    data, held_out = cfg.data, cfg.eval
    if held_out.path is not None:
        local = Path(held_out.path).expanduser()
        if local.is_dir() and split_file(local, held_out.split) is None:
            raise ValueError(f"eval.path: folder {local} has no {held_out.split}.jsonl (eval.split), "
                             "nor a .json, .parquet or .arrow file of that split")
        if not local.exists() and looks_local(held_out.path, DATA_SUFFIXES):
            raise ValueError(f"eval.path: file not found: {local}")
        return
    if data.name == "synthetic" or data.path is None:
        return
    local = Path(data.path).expanduser()
    if local.is_file():
        raise ValueError(f"eval.path: data.path {local} is one file, the training problems; name a file of "
                         "held-out problems, or give data.path as a folder of <split> files")
    if local.is_dir() and split_file(local, held_out.split) is None:
        raise ValueError(f"eval.split: folder {local} (data.path) has no {held_out.split} file; set eval.split "
                         "or eval.path")


def validate_against_model(cfg: TrainConfig, context: int) -> None:
    """Limits that need the model's context window (`context` tokens): every sequence must fit in it."""
    where = f"the context of model.name {cfg.model.name!r} ({context} tokens)"
    rollout = cfg.rollout
    if rollout.mode != "vanilla":
        needed = rollout.max_new_tokens + rollout.max_tokens_per_step
        field_name = "rollout.speculation.max_nodes" if rollout.mode == "speculation" else "rollout.fastgrpo.max_nodes"
        if needed > context:
            raise ValueError(
                f"rollout.max_new_tokens ({rollout.max_new_tokens}) + {field_name} "
                f"({rollout.max_tokens_per_step}) = {needed} exceeds {where}"
            )
    elif rollout.max_new_tokens >= context:
        raise ValueError(f"rollout.max_new_tokens ({rollout.max_new_tokens}) leaves no room for a prompt in {where}")
    if cfg.learner.max_seq_len > context:
        raise ValueError(f"learner.max_seq_len ({cfg.learner.max_seq_len}) exceeds {where}")
