"""Typed configuration of the GRPO learner (mirrored by `conf/learner/*.yaml`)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from specroll.grpo import ON_INVALID_MODES, PolicyLossConfig

ZERO_STAGES = (0, 1, 2, 3)
# fp16 needs loss scaling and is unsupported on CPU; bf16 has float32's range.
LEARNER_DTYPES = ("float32", "bfloat16")
LR_SCHEDULES = ("constant", "cosine")


def check_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_finite(name: str, value: Any, low: float, high: float = math.inf) -> None:
    if not isinstance(value, (int, float)) or not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{name} must be a finite number in [{low}, {high}], got {value!r}")


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
        if self.device != "auto" and self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:i]', got {self.device!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        timeout = self.collective_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ValueError(f"collective_timeout_s must be a finite number > 0, got {timeout!r}")

    def validate_optimizer(self) -> None:
        """DeepSpeed's stage and precision, AdamW and the learning-rate schedule."""
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {self.zero_stage!r}")
        if self.dtype not in LEARNER_DTYPES:
            raise ValueError(f"dtype must be one of {LEARNER_DTYPES}, got {self.dtype!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr!r}")
        check_finite("weight_decay", self.weight_decay, 0.0)
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if not (isinstance(self.adam_eps, (int, float)) and self.adam_eps > 0):
            raise ValueError(f"adam_eps must be > 0, got {self.adam_eps!r}")
        check_int("warmup_steps", self.warmup_steps, minimum=0)
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        check_finite("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        if self.total_steps is not None:
            check_int("total_steps", self.total_steps)
        if self.lr_schedule == "cosine":
            if self.total_steps is None:
                raise ValueError("total_steps must be set when lr_schedule is 'cosine'")
            if self.total_steps <= self.warmup_steps:
                raise ValueError(
                    f"total_steps ({self.total_steps}) must exceed warmup_steps ({self.warmup_steps}) "
                    "for the cosine schedule"
                )
        check_finite("grad_clip", self.grad_clip, 0.0)

    def validate_batching(self) -> None:
        """Micro-batches and their checkpointing, mini-batches, epochs and the sequence lengths `update` accepts."""
        check_int("micro_batch_tokens", self.micro_batch_tokens)
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(f"activation_checkpointing must be a bool, got {self.activation_checkpointing!r}")
        check_int("ppo_epochs", self.ppo_epochs)
        if self.mini_batch_size is not None:
            check_int("mini_batch_size", self.mini_batch_size)
        check_int("max_response_len", self.max_response_len)
        check_int("max_seq_len", self.max_seq_len)
        if self.max_response_len >= self.max_seq_len:
            raise ValueError(
                f"max_response_len ({self.max_response_len}) must be < max_seq_len ({self.max_seq_len}): "
                "every sequence holds at least one prompt token"
            )

    def validate_loss(self) -> None:
        """Rewards, advantages, the training temperature, the reference policy and the GRPO loss."""
        if self.on_invalid_reward not in ON_INVALID_MODES:
            raise ValueError(
                f"on_invalid_reward must be one of {ON_INVALID_MODES}, got {self.on_invalid_reward!r}"
            )
        if not isinstance(self.scale_advantages_by_std, bool):
            raise ValueError(f"scale_advantages_by_std must be a bool, got {self.scale_advantages_by_std!r}")
        if self.overlong_max_len is not None:
            check_int("overlong_max_len", self.overlong_max_len)
            check_int("overlong_buffer_len", self.overlong_buffer_len)
            if self.overlong_buffer_len > self.overlong_max_len:
                raise ValueError(f"overlong_buffer_len ({self.overlong_buffer_len}) must be <= "
                                 f"overlong_max_len ({self.overlong_max_len})")
        elif self.overlong_buffer_len != 0:
            raise ValueError(f"overlong_buffer_len ({self.overlong_buffer_len!r}) needs overlong_max_len set")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        if not isinstance(self.use_reference, bool):
            raise ValueError(f"use_reference must be a bool, got {self.use_reference!r}")
        if not isinstance(self.loss, PolicyLossConfig):
            raise ValueError(f"loss must be a PolicyLossConfig, got {type(self.loss).__name__}")
        try:
            self.loss.validate()
        except ValueError as exc:
            raise ValueError(f"loss.{exc}") from exc
        if self.loss.kl_coef > 0 and not self.use_reference:
            raise ValueError("loss.kl_coef > 0 needs use_reference=True (the KL is to the reference policy)")

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
