"""Typed configuration of the GRPO learner (mirrored by `conf/learner/*.yaml`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from specroll.config_checks import (FieldError, check_bool, check_choice, check_device, check_int, check_number,
                                    check_positive, check_probability, check_seed, require)
from specroll.grpo import ON_INVALID_MODES, PolicyLossConfig

ZERO_STAGES = (0, 1, 2, 3)
# fp16 needs loss scaling and is unsupported on CPU; bf16 has float32's range.
LEARNER_DTYPES = ("float32", "bfloat16")
LR_SCHEDULES = ("constant", "cosine")


@dataclass
class LearnerConfig:
    """How the policy is optimised: DeepSpeed set-up, optimiser, batching and the GRPO loss."""

    zero_stage: int = 0
    """DeepSpeed ZeRO stage 0-3: 1 shards optimiser states, 2 also gradients, 3 also weights."""

    dtype: str = "float32"
    """Training precision, "float32" or "bfloat16" (DeepSpeed keeps float32 master weights)."""

    lr: float = 1e-6
    """Peak learning rate of AdamW."""

    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW moment coefficients, each in [0, 1)."""

    adam_eps: float = 1e-8
    """AdamW denominator epsilon."""

    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from lr / (warmup_steps + 1) to lr."""

    lr_schedule: str = "constant"
    """After warm-up: "constant", or "cosine" decay to `min_lr_ratio * lr` at `total_steps`."""

    min_lr_ratio: float = 0.0
    """Floor of the cosine schedule as a fraction of `lr`, in [0, 1]."""

    total_steps: int | None = None
    """Optimizer steps of the whole run; required by the cosine schedule."""

    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""

    micro_batch_tokens: int = 4096
    """Token budget of one forward/backward: a micro-batch holds as many sequences as fit in
    this many padded tokens (prompt + response). A longer sequence runs alone."""

    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward instead of keeping its activations: a micro-batch
    then holds every layer's input and one layer's intermediates, for about one more forward of
    compute. On in the GPU presets, where activations, not weights, fill a learner's memory."""

    ppo_epochs: int = 1
    """Passes over each rollout batch; epochs after the first are off-policy (clipping acts)."""

    mini_batch_size: int | None = None
    """Sequences per optimizer step; None takes the whole rollout batch in one step."""

    max_response_len: int = 512
    """Longest response accepted by `update`, in tokens."""

    max_seq_len: int = 1024
    """Longest prompt + response accepted by `update`, in tokens."""

    on_invalid_reward: str = "error"
    """Non-finite rewards: "error" raises naming the sample; "skip" drops its whole group."""

    scale_advantages_by_std: bool = True
    """Divide group-centred rewards by the group std (GRPO); False gives Dr.GRPO."""

    overlong_max_len: int | None = None
    """DAPO's soft overlong punishment: L_max, the response length at which the penalty added to
    the reward reaches -1 (the rollout's max_new_tokens); None: off (see `grpo.overlong`)."""

    overlong_buffer_len: int = 0
    """L_cache: the penalty falls linearly from 0 to -1 over the last this-many tokens before
    `overlong_max_len`; in [1, overlong_max_len] when that is set."""

    temperature: float = 1.0
    """Logits are divided by this before the log-softmax, so training log-probs are those of
    the distribution the rollout sampled from (its temperature)."""

    use_reference: bool = False
    """Keep a frozen copy of the initial policy and report (and, with `loss.kl_coef`, penalise)
    the KL to it."""

    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Clipping, KL penalty and aggregation of the GRPO policy loss."""

    device: str = "auto"
    """"auto" (CUDA when present, else CPU), "cpu" or "cuda"."""

    collective_timeout_s: float = 1800.0
    """Longest a rank waits in a collective of the learner's process group (DeepSpeed's and
    ours) before it fails: long enough for rank 0 writing its checkpoint files to network
    storage while the others wait (torch's default is 10 minutes)."""

    seed: int = 0
    """Seeds the mini-batch shuffling (derived per step, so a resumed run shuffles alike)."""

    def __post_init__(self) -> None:
        # Hydra and JSON hand over plain containers.
        if isinstance(self.loss, dict):
            self.loss = PolicyLossConfig(**self.loss)
        if isinstance(self.betas, list):
            self.betas = tuple(self.betas)
        self.validate()

    def validate(self) -> None:
        """Raise `ValueError` naming the first invalid field."""
        self.validate_optimizer()
        self.validate_batching()
        self.validate_loss()
        check_device("device", self.device)
        check_seed("seed", self.seed)
        check_positive("collective_timeout_s", self.collective_timeout_s)

    def validate_optimizer(self) -> None:
        """DeepSpeed's stage and precision, AdamW and the learning-rate schedule."""
        check_choice("zero_stage", self.zero_stage, ZERO_STAGES)
        check_choice("dtype", self.dtype, LEARNER_DTYPES)
        check_positive("lr", self.lr)
        check_number("weight_decay", self.weight_decay, 0)
        require(len(self.betas) == 2, "betas", self.betas, "two numbers in [0, 1)")
        for i, beta in enumerate(self.betas):
            check_probability(f"betas[{i}]", beta, high_open=True)
        check_positive("adam_eps", self.adam_eps)
        check_int("warmup_steps", self.warmup_steps, 0)
        check_choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        check_probability("min_lr_ratio", self.min_lr_ratio)
        if self.total_steps is not None:
            check_int("total_steps", self.total_steps, 1)
        if self.lr_schedule == "cosine":
            require(self.total_steps is not None, "total_steps", None, "an int", why="the cosine schedule ends there")
            check_int("total_steps", self.total_steps, self.warmup_steps + 1,
                      why="the cosine schedule decays after warmup_steps")
        check_number("grad_clip", self.grad_clip, 0)

    def validate_batching(self) -> None:
        """Micro-batches and their checkpointing, mini-batches, epochs and the sequence lengths `update` accepts."""
        check_int("micro_batch_tokens", self.micro_batch_tokens, 1)
        check_bool("activation_checkpointing", self.activation_checkpointing)
        check_int("ppo_epochs", self.ppo_epochs, 1)
        if self.mini_batch_size is not None:
            check_int("mini_batch_size", self.mini_batch_size, 1)
        check_int("max_response_len", self.max_response_len, 1)
        check_int("max_seq_len", self.max_seq_len, 1)
        require(self.max_response_len < self.max_seq_len, "max_response_len", self.max_response_len,
                f"< max_seq_len ({self.max_seq_len})", why="every sequence holds at least one prompt token")

    def validate_loss(self) -> None:
        """Rewards, advantages, the training temperature, the reference policy and the GRPO loss."""
        check_choice("on_invalid_reward", self.on_invalid_reward, ON_INVALID_MODES)
        check_bool("scale_advantages_by_std", self.scale_advantages_by_std)
        if self.overlong_max_len is not None:
            check_int("overlong_max_len", self.overlong_max_len, 1)
            check_int("overlong_buffer_len", self.overlong_buffer_len, 1, self.overlong_max_len)
        else:
            require(self.overlong_buffer_len == 0, "overlong_buffer_len", self.overlong_buffer_len,
                    "0 while overlong_max_len is null")
        check_positive("temperature", self.temperature)
        check_bool("use_reference", self.use_reference)
        require(isinstance(self.loss, PolicyLossConfig), "loss", self.loss, "a PolicyLossConfig")
        try:
            self.loss.validate()
        except FieldError as exc:
            raise exc.within("loss") from exc
        require(self.loss.kl_coef == 0 or self.use_reference, "loss.kl_coef", self.loss.kl_coef,
                "0 without use_reference", why="the KL is to the reference policy")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (what a checkpoint records as the resolved config)."""
        out = asdict(self)
        out["betas"] = list(self.betas)
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "LearnerConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown learner config fields: {unknown}")
        return cls(**values)
