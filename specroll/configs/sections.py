"""The sections of a training run's config, mirrored by the groups of `conf/`.

Each section checks its own fields when built and names the field in its `ValueError`;
checks across sections live in `TrainConfig`. Components that already have a config
(`SpeculationConfig`, `SyntheticConfig`, `RecordFormat`, `RewardConfig`, `LearnerConfig`) are nested as they are;
the logger's section (`LoggerSection`) lives with telemetry.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specroll.data import INSTRUCTION, NUMERIC_FORMATS, PROBLEM_SOURCES, RecordFormat, RewardConfig, SyntheticConfig
from specroll.fastgrpo import FastGRPOConfig
from specroll.models import (
    build_tiny_model,
    load_causal_lm,
    resolve_checkpoint,
    resolve_device,
    resolve_dtype,
    tiny_config,
)
from specroll.models.config import SUPPORTED_MODEL_TYPES
from specroll.models.loading import DTYPES
from specroll.models.model_cache import stage, staged
from specroll.rollout import SamplingParams
from specroll.speculation import SpeculationConfig

TINY_PREFIX = "tiny-"
ROLLOUT_MODES = ("vanilla", "speculation", "fastgrpo")
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
WEIGHT_SYNC_PATHS = ("collective", "object_store")  # cluster.weight_sync


def check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_number(name: str, value: Any, low: float, low_inclusive: bool = True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (value == low and not low_inclusive):
        bound = ">=" if low_inclusive else ">"
        raise ValueError(f"{name} must be a finite number {bound} {low}, got {value!r}")


def check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def check_resources(name: str, resources: dict) -> None:
    """Ray custom resources: named, positive amounts; CPUs and GPUs have fields of their own."""
    for key, amount in resources.items():
        if not isinstance(key, str) or not key or key in RAY_BUILTIN_RESOURCES:
            raise ValueError(f"{name} names custom resources, not {key!r} (CPUs and GPUs have cpus_* / gpus_* fields)")
        check_number(f"{name}.{key}", amount, 0.0, low_inclusive=False)


def check_port_range(name: str, value: Any) -> None:
    """[low, high]: unprivileged ports, low <= high."""
    ports = list(value) if isinstance(value, (list, tuple)) else None
    if ports is None or len(ports) != 2:
        raise ValueError(f"{name} must be [low, high], got {value!r}")
    for port in ports:
        if isinstance(port, bool) or not isinstance(port, int) or not 1024 <= port <= 65535:
            raise ValueError(f"{name} must hold ports in [1024, 65535], got {value!r}")
    if ports[0] > ports[1]:
        raise ValueError(f"{name} must be [low, high] with low <= high, got {value!r}")


def check_device(name: str, value: str) -> None:
    if value != "auto" and value.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"{name} must be 'auto', 'cpu' or 'cuda[:i]', got {value!r}")


@dataclass
class ModelSection:
    """The policy: which weights, in which precision, on which device (rollout side)."""

    # An alias (smollm2-135m-instruct), a .gguf file, a Hugging Face directory, a hub id
    # (needs network), or tiny-llama / tiny-qwen2 / tiny-qwen3: the 2-layer random model of
    # `specroll.models.build_tiny_model(<type>, seed=<run seed>)` for plumbing tests.
    name: str = "smollm2-135m-instruct"
    dtype: str = "float32"  # rollout weights: float32, bfloat16 or float16
    device: str = "auto"  # auto (CUDA when present, else CPU), cpu or cuda[:i]
    # tiny-* only: a model (as in `name`) whose tokenizer is used; the tiny vocabulary and EOS
    # then match it. null: the tiny 64-token vocabulary and no tokenizer.
    tokenizer: str | None = None
    # Where the driver stages the model's files once for every actor (GGUF converted, hub model
    # downloaded, local directory linked): a folder on storage every node sees; null: <run_dir>/model_cache
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must be a non-empty string")
        if self.cache_dir is not None and not self.cache_dir:
            raise ValueError("cache_dir must be null or a non-empty path")
        check_choice("dtype", self.dtype, tuple(DTYPES))
        check_device("device", self.device)
        if self.tiny_type is not None and self.tiny_type not in SUPPORTED_MODEL_TYPES:
            tiny = ", ".join(TINY_PREFIX + t for t in SUPPORTED_MODEL_TYPES)
            raise ValueError(f"name {self.name!r} is not a tiny model; tiny models: {tiny}")
        if self.tokenizer is not None and self.tiny_type is None:
            raise ValueError(f"tokenizer is only for tiny-* models; {self.name!r} brings its own")

    @property
    def tiny_type(self) -> str | None:
        """The architecture of a tiny-* model ("llama", "qwen2", "qwen3"); None for real weights."""
        return self.name[len(TINY_PREFIX):] if self.name.startswith(TINY_PREFIX) else None

    def stage(self, cache: Path) -> None:
        """Fetch or convert the model's files (a tiny model's tokenizer alone) once, into `cache`:
        run by the driver before any actor starts."""
        if self.tiny_type is None:
            stage(self.name, cache)
        elif self.tokenizer is not None:
            stage(self.tokenizer, cache, weights=False)

    def load(self, seed: int = 0, cache: Path | None = None):
        """`(CausalLM, tokenizer or None)` as this section describes them; with `cache`, read from
        the files the driver staged there (`stage`), never fetched here."""
        if self.tiny_type is None:
            model_dir = None if cache is None else staged(self.name, cache)
            return load_causal_lm(self.name, dtype=self.dtype, device=self.device, model_dir=model_dir)
        tokenizer, sized_to_tokenizer = self.load_tokenizer(cache), {}
        if tokenizer is not None:
            eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
            sized_to_tokenizer = dict(vocab_size=len(tokenizer), eos_token_ids=eos)
        model = build_tiny_model(self.tiny_type, seed=seed, **sized_to_tokenizer)
        return model.to(device=resolve_device(self.device), dtype=resolve_dtype(self.dtype)).eval(), tokenizer


    def load_tokenizer(self, cache: Path | None = None):
        """The tokenizer alone, without the weights: the model's own, or `tokenizer`'s for a tiny
        model (None when it has none); with `cache`, from the files staged there."""
        source = self.name if self.tiny_type is None else self.tokenizer
        if source is None:
            return None
        from transformers import AutoTokenizer

        if cache is not None:
            return AutoTokenizer.from_pretrained(staged(source, cache, weights=self.tiny_type is None))
        return AutoTokenizer.from_pretrained(resolve_checkpoint(source))

    def context_length(self) -> int:
        """The model's context window in tokens, read from its config alone (no weights)."""
        if self.tiny_type is not None:
            return tiny_config(self.tiny_type).max_position_embeddings
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(resolve_checkpoint(self.name)).max_position_embeddings


LONG_PROMPTS = ("fail", "drop")  # data.long_prompts


@dataclass
class DataSection:
    """Which problems the policy practises on, how they are asked, how many per step, and how answers are scored."""

    # synthetic: built-in generated problems (no download); gsm8k: GSM8K; any other name: the problem
    # set at `path`, read as `records` says (presets in conf/data/: math, dapo_math)
    name: str = "synthetic"
    # a jsonl, json, parquet or arrow file, a folder of <split>.<suffix> files, or a hub dataset name
    # (needs network); null = openai/gsm8k for gsm8k. Ignored for synthetic.
    path: str | None = None
    subset: str | None = None  # the hub dataset's configuration (gsm8k falls back to main); ignored for files
    split: str = "train"  # split to train on, from a folder or the hub; ignored for synthetic
    limit: int | None = None  # keep only the first `limit` problems; null keeps all
    records: RecordFormat = field(default_factory=RecordFormat)  # fields, answer format, levels; ignored for synthetic
    instruction: str = INSTRUCTION  # follows every question in the user message; '' sends the question alone
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)  # generator settings for synthetic
    prompts_per_step: int = 8  # problems per training step; each gets rollout.n responses
    shuffle: bool = True  # visit problems in a seeded shuffled order each epoch
    # a prompt with no room for a whole response (learner.max_seq_len, the model's context): fail names
    # the first one before the run starts; drop leaves all of them out of the run, with a count
    long_prompts: str = "fail"
    reward: RewardConfig = field(default_factory=RewardConfig)  # reward function (number or math_verify) and weights

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must be a non-empty string")
        if self.path is None and self.name not in PROBLEM_SOURCES:
            raise ValueError(f"path must be a file, a folder or a hub dataset name for problem set {self.name!r} "
                             f"(only {', '.join(PROBLEM_SOURCES)} load by name alone)")
        if not self.split:
            raise ValueError("split must be a non-empty string")
        if self.limit is not None:
            check_int("limit", self.limit, 1)
        check_int("prompts_per_step", self.prompts_per_step, 1)
        check_choice("long_prompts", self.long_prompts, LONG_PROMPTS)
        answers = self.records.answer_format
        if self.name != "synthetic" and self.reward.function == "number" and answers not in NUMERIC_FORMATS:
            raise ValueError(f"reward.function 'number' compares numbers, but records.answer_format {answers!r} "
                             "gives LaTeX answers: use math_verify")


@dataclass
class EvalSection:
    """The held-out evaluation (`eval_every`, `python -m specroll.eval`): which problems, and how pass@k samples."""

    # The held-out split, read from data.path's folder or the hub; for synthetic problems: those drawn
    # (same generator, same seed) after the training set's data.synthetic.num_problems
    split: str = "test"
    # A file, folder or hub name of held-out problems, read as data.records says; null: data.path at `split`
    path: str | None = None
    limit: int | None = 64  # evaluate the first `limit` held-out problems; null: all
    samples: int = 0  # responses sampled per problem (rollout temperature, top-p, top-k) for pass@k; 0: greedy accuracy only
    k: list[int] = field(default_factory=lambda: [1])  # report pass@k for each k (each <= samples) when samples > 0
    # problems per generate call, in training and in `python -m specroll.eval` alike, so that the
    # same weights give the same responses in both
    batch_size: int = 16
    seed: int = 0  # seeds the pass@k samples
    before_training: bool = True  # with eval_every: also evaluate the initial policy before a fresh run's first step

    def __post_init__(self) -> None:
        if not self.split:
            raise ValueError("split must be a non-empty string")
        if self.path is not None and not self.path:
            raise ValueError("path must be null or a non-empty path")
        if self.limit is not None:
            check_int("limit", self.limit, 1)
        check_int("samples", self.samples, 0)
        check_int("batch_size", self.batch_size, 1)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        self.k = list(self.k)
        if self.samples and not self.k:
            raise ValueError("k must name at least one k when samples > 0")
        for k in self.k:
            check_int("k", k, 1)
            if self.samples and k > self.samples:
                raise ValueError(f"k ({k}) must be <= samples ({self.samples}): pass@k draws k of the sampled responses")


@dataclass
class RolloutSection:
    """How responses are sampled (vanilla or speculative decoding, which is exact)."""

    # vanilla: one token per step; speculation: SpecRoll's speculative decoding with `speculation`;
    # fastgrpo: the FastGRPO-style baseline with `fastgrpo` (its own drafter, SpecRoll's exact verification)
    mode: str = "speculation"
    temperature: float = 1.0  # > 0; the learner scores responses at this temperature too
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    max_new_tokens: int = 256  # response length cap in tokens
    n: int = 8  # responses per prompt: the GRPO group size, >= 2
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)  # used when mode is speculation
    fastgrpo: FastGRPOConfig = field(default_factory=FastGRPOConfig)  # the FastGRPO-style baseline; used when mode is fastgrpo
    # Run the plain decode step compiled (torch.compile; CUDA graphs on GPUs); false = eager.
    compile: bool = False
    sync_every: int = 8  # decode steps between host reads of finished rows (a tree step reads unless speculation.sync_free_trees applies), >= 1

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, ROLLOUT_MODES)
        if self.temperature == 0:
            raise ValueError("temperature must be > 0: greedy responses of a group are all alike, so GRPO learns nothing")
        check_number("temperature", self.temperature, 0.0, low_inclusive=False)
        # Before SamplingParams, whose own rule (n >= 1) is not GRPO's.
        if isinstance(self.n, int) and self.n < 2:
            raise ValueError(f"n must be >= 2: GRPO advantages compare the responses to one prompt, got {self.n}")
        self.sampling_params(seed=0)  # SamplingParams checks the sampling fields
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {self.sync_every}")

    def sampling_params(self, seed: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens, n=self.n, seed=seed)

    @property
    def speculates(self) -> bool:
        """Whether SpecRoll's speculative decoding (horizon heads, their consolidation) is in use."""
        return self.mode == "speculation"

    @property
    def max_tokens_per_step(self) -> int:
        """Most tokens a decoding step appends per response (1 for vanilla)."""
        if self.mode == "speculation":
            return self.speculation.max_nodes
        return self.fastgrpo.max_tokens_per_step if self.mode == "fastgrpo" else 1


@dataclass
class ClusterSection:
    """Ray resources: how many actors of each kind and what each one reserves."""

    num_rollout_actors: int = 1  # rollout actors; each holds a policy replica and a shard of the prompts
    # Ray num_cpus of each rollout actor: placement only; on CPUs its torch threads follow the
    # phase (the whole node when phases alternate, a split by reserved CPUs with overlap)
    cpus_per_rollout_actor: float = 1.0
    gpus_per_rollout_actor: float = 0.0  # Ray num_gpus of each rollout actor; fractions share a GPU
    learner_world_size: int = 1  # learner ranks (DeepSpeed data parallel), one actor each
    cpus_per_learner: float = 1.0  # Ray num_cpus of each learner rank; threads as for rollout actors
    gpus_per_learner: float = 0.0  # Ray num_gpus of each learner rank
    gpus_per_consolidation_actor: float = 0.0  # Ray num_gpus of the head-consolidation actor (slow path); fractions share a GPU
    ray_address: str | None = None  # null starts a local Ray cluster; "auto" or ray://host:port joins one
    remote_timeout_s: float = 600.0  # longest wait for any remote call before the run fails
    overlap: bool = False  # one-step off-policy: generate step t+1 while the learner trains on step t (CPU threads split)
    # CPU actors run the cores their phase leaves free (see specroll/actors/threads.py); false: one
    # thread per reserved CPU, far faster on a machine shared with other busy processes
    phase_threads: bool = True
    # Ray custom resources each actor of a kind asks for, {name: amount}: it is placed on a node
    # offering them (`ray start --resources='{"rollout": 1}'`); {} places it anywhere
    rollout_resources: dict[str, float] = field(default_factory=dict)
    learner_resources: dict[str, float] = field(default_factory=dict)  # each learner rank's
    consolidation_resources: dict[str, float] = field(default_factory=dict)  # the head-consolidation actor's
    # Ports [low, high] that learner rank 0 (and any group it leads) may listen on, at its node's
    # address: open them between the nodes; each group takes one that is free there
    master_port_range: list[int] = field(default_factory=lambda: [29500, 29599])
    # How new policy weights reach the rollout (and head-consolidation) actors. collective: learner
    # rank 0 streams them over a process group of its own (NCCL when every member is on a
    # GPU, else gloo), one bucket at a time; object_store: one whole-model object in Ray's object
    # store, which every receiver reads (the fallback, e.g. where the actors cannot open ports to each other)
    weight_sync: str = "collective"
    # collective: the bytes of one bucket, in MiB (under ZeRO-3 also what each learner rank gathers
    # at once); a tensor larger than a bucket goes alone
    weight_sync_bucket_mb: float = 256.0
    # GiB of memory per GPU (80 for an 80 GB A100 / H100): `python -m specroll.plan` and preflight
    # refuse a run whose actors need more on any GPU; null = no check (CPU runs)
    gpu_memory_gb: float | None = None

    def __post_init__(self) -> None:
        check_int("num_rollout_actors", self.num_rollout_actors, 1)
        if self.gpu_memory_gb is not None:
            check_number("gpu_memory_gb", self.gpu_memory_gb, 0.0, low_inclusive=False)
        check_int("learner_world_size", self.learner_world_size, 1)
        for name in ("cpus_per_rollout_actor", "cpus_per_learner"):
            check_number(name, getattr(self, name), 0.0, low_inclusive=False)
        for name in ("gpus_per_rollout_actor", "gpus_per_learner", "gpus_per_consolidation_actor"):
            gpus = getattr(self, name)
            check_number(name, gpus, 0.0)
            if gpus > 1 and gpus != int(gpus):
                raise ValueError(f"{name} must be a whole number when above 1 (Ray's rule), got {gpus}")
        if self.ray_address is not None and not self.ray_address:
            raise ValueError("ray_address must be null or a non-empty address")
        check_number("remote_timeout_s", self.remote_timeout_s, 0.0, low_inclusive=False)
        for name in ("rollout_resources", "learner_resources", "consolidation_resources"):
            check_resources(name, getattr(self, name))
        check_port_range("master_port_range", self.master_port_range)
        check_choice("weight_sync", self.weight_sync, WEIGHT_SYNC_PATHS)
        check_number("weight_sync_bucket_mb", self.weight_sync_bucket_mb, 0.0, low_inclusive=False)

    @property
    def weight_sync_bucket_bytes(self) -> int:
        return max(1, int(self.weight_sync_bucket_mb * 2**20))
