"""The sections of a training run's config, mirrored by the groups of `conf/`.

Each section checks its own fields when built (`specroll.config_checks`) and names the field
in its `FieldError`; checks across sections live in `TrainConfig`. Components that already have a
config (`ModelConfig`, `SpeculationConfig`, `SyntheticConfig`, `RecordFormat`, `RewardConfig`,
`LearnerConfig`, `LoggerConfig`) live with their component and are nested here as they are.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specroll.config_checks import (check_bool, check_choice, check_int, check_number, check_positive, check_seed,
                                    check_text, require)
from specroll.data import INSTRUCTION, NUMERIC_FORMATS, PROBLEM_SOURCES, RecordFormat, RewardConfig, SyntheticConfig
from specroll.fastgrpo import FastGRPOConfig
from specroll.rollout import SAMPLERS, SamplingParams
from specroll.speculation import SpeculationConfig

ROLLOUT_MODES = ("vanilla", "speculation", "fastgrpo")
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
WEIGHT_SYNC_PATHS = ("collective", "object_store")  # cluster.weight_sync


def check_resources(name: str, resources: dict) -> None:
    """Ray custom resources: named, positive amounts; CPUs and GPUs have fields of their own."""
    for key, amount in resources.items():
        require(isinstance(key, str) and key and key not in RAY_BUILTIN_RESOURCES, name, resources,
                "a mapping of custom resource names to amounts", why=f"{key!r} is no custom resource "
                "(CPUs and GPUs have cpus_* / gpus_* fields)")
        check_positive(f"{name}.{key}", amount)


def check_port_range(name: str, value: object) -> None:
    """[low, high]: unprivileged ports, low <= high."""
    ports = list(value) if isinstance(value, (list, tuple)) else []
    ok = len(ports) == 2 and all(isinstance(p, int) and not isinstance(p, bool) and 1024 <= p <= 65535 for p in ports)
    require(ok and ports[0] <= ports[1], name, value, "[low, high], ports in [1024, 65535] with low <= high")


LONG_PROMPTS = ("fail", "drop")  # data.long_prompts
AT_CAP = ("train", "skip")  # dynamic_sampling.at_cap


@dataclass
class DynamicSamplingConfig:
    """Which groups a step trains on, and how many more it may sample to fill its batch."""

    enabled: bool = False  # drop groups whose rewards are all equal and sample new ones within the step
    # groups with signal a step trains on; null: data.prompts_per_step
    target_groups: int | None = None
    # prompts drawn by each extra round; null: as many as groups are still missing (more saves rounds
    # when many groups lack signal: a round costs about its longest response on a GPU)
    round_prompts: int | None = None
    max_extra_rounds: int = 4  # extra sampling rounds a step may take, >= 0 (verl's max_num_gen_batches - 1)
    # at the cap with fewer groups than the target: train on those kept (a multiple of the learner
    # ranks; none left skips), or skip the step's update
    at_cap: str = "train"

    def __post_init__(self) -> None:
        check_bool("enabled", self.enabled)
        if self.target_groups is not None:
            check_int("target_groups", self.target_groups, 1)
        if self.round_prompts is not None:
            check_int("round_prompts", self.round_prompts, 1)
        check_int("max_extra_rounds", self.max_extra_rounds, 0)
        check_choice("at_cap", self.at_cap, AT_CAP)


@dataclass
class DataConfig:
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
        check_text("name", self.name)
        require(self.path is not None or self.name in PROBLEM_SOURCES, "path", self.path,
                f"a file, a folder or a hub dataset name for problem set {self.name!r}",
                why=f"only {', '.join(PROBLEM_SOURCES)} load by name alone")
        check_text("split", self.split)
        if self.limit is not None:
            check_int("limit", self.limit, 1)
        check_int("prompts_per_step", self.prompts_per_step, 1)
        check_choice("long_prompts", self.long_prompts, LONG_PROMPTS)
        answers = self.records.answer_format
        require(self.name == "synthetic" or self.reward.function != "number" or answers in NUMERIC_FORMATS,
                "reward.function", self.reward.function, "math_verify",
                why=f"number compares numbers, but records.answer_format {answers!r} gives LaTeX answers")


@dataclass
class EvalConfig:
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
        check_text("split", self.split)
        check_text("path", self.path, optional=True)
        if self.limit is not None:
            check_int("limit", self.limit, 1)
        check_int("samples", self.samples, 0)
        check_int("batch_size", self.batch_size, 1)
        check_seed("seed", self.seed)
        self.k = list(self.k)
        require(self.k or not self.samples, "k", self.k, "at least one k when samples > 0")
        for i, k in enumerate(self.k):
            check_int(f"k[{i}]", k, 1)
            if self.samples:
                check_int(f"k[{i}]", k, 1, self.samples, why="pass@k draws k of the `samples` responses")


@dataclass
class RolloutConfig:
    """How responses are sampled (vanilla or speculative decoding, which is exact)."""

    # vanilla: one token per step; speculation: SpecRoll's speculative decoding with `speculation`;
    # fastgrpo: the FastGRPO-style baseline with `fastgrpo` (its own drafter, SpecRoll's exact verification)
    mode: str = "speculation"
    temperature: float = 1.0  # > 0; the learner scores responses at this temperature too
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    # How a draw becomes a token: inverse_cdf, or gumbel (a seed then gives other responses), whose noise drafts can read
    sampler: str = "inverse_cdf"
    max_new_tokens: int = 256  # response length cap in tokens
    n: int = 8  # responses per prompt: the GRPO group size, >= 2
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)  # used when mode is speculation
    fastgrpo: FastGRPOConfig = field(default_factory=FastGRPOConfig)  # the FastGRPO-style baseline; used when mode is fastgrpo
    # Run the plain decode step compiled (torch.compile; CUDA graphs on GPUs); false = eager.
    compile: bool = False
    sync_every: int = 8  # decode steps between host reads of finished rows (a tree step reads unless speculation.sync_free_trees applies), >= 1

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, ROLLOUT_MODES)
        check_number("temperature", self.temperature, 0, low_open=True,
                     why="a greedy group's responses are all alike, so GRPO learns nothing")
        check_number("top_p", self.top_p, 0, 1, low_open=True)
        check_int("top_k", self.top_k, 0)
        check_choice("sampler", self.sampler, SAMPLERS)
        check_int("max_new_tokens", self.max_new_tokens, 1)
        check_int("n", self.n, 2, why="GRPO advantages compare the responses to one prompt")
        check_bool("compile", self.compile)
        check_int("sync_every", self.sync_every, 1)

    def sampling_params(self, seed: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens, n=self.n, seed=seed, sampler=self.sampler)

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
class ClusterConfig:
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
            check_positive("gpu_memory_gb", self.gpu_memory_gb)
        check_int("learner_world_size", self.learner_world_size, 1)
        for name in ("cpus_per_rollout_actor", "cpus_per_learner"):
            check_positive(name, getattr(self, name))
        for name in ("gpus_per_rollout_actor", "gpus_per_learner", "gpus_per_consolidation_actor"):
            gpus = getattr(self, name)
            check_number(name, gpus, 0)
            require(gpus <= 1 or gpus == int(gpus), name, gpus, "a fraction up to 1 or a whole number",
                    why="Ray's rule")
        check_text("ray_address", self.ray_address, optional=True)
        check_positive("remote_timeout_s", self.remote_timeout_s)
        for name in ("rollout_resources", "learner_resources", "consolidation_resources"):
            check_resources(name, getattr(self, name))
        check_port_range("master_port_range", self.master_port_range)
        check_choice("weight_sync", self.weight_sync, WEIGHT_SYNC_PATHS)
        check_positive("weight_sync_bucket_mb", self.weight_sync_bucket_mb)

    @property
    def weight_sync_bucket_bytes(self) -> int:
        return max(1, int(self.weight_sync_bucket_mb * 2**20))
