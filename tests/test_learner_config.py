"""LearnerConfig validation, the learning-rate schedule and the DeepSpeed config it builds."""

import pytest

from specroll.grpo import PolicyLossConfig
from specroll.learner import LearnerConfig, build_ds_config, lr_multiplier


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"zero_stage": 4}, "zero_stage"),
        ({"dtype": "float16"}, "dtype"),
        ({"lr": 0.0}, "lr"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"lr_schedule": "linear"}, "lr_schedule"),
        ({"lr_schedule": "cosine"}, "total_steps"),
        ({"lr_schedule": "cosine", "total_steps": 5, "warmup_steps": 5}, "total_steps"),
        ({"grad_clip": float("nan")}, "grad_clip"),
        ({"micro_batch_tokens": 0}, "micro_batch_tokens"),
        ({"activation_checkpointing": 1}, "activation_checkpointing"),
        ({"ppo_epochs": 0}, "ppo_epochs"),
        ({"mini_batch_size": 0}, "mini_batch_size"),
        ({"max_response_len": 0}, "max_response_len"),
        ({"max_response_len": 64, "max_seq_len": 64}, "max_response_len"),
        ({"on_invalid_reward": "ignore"}, "on_invalid_reward"),
        ({"temperature": 0.0}, "temperature"),
        ({"loss": PolicyLossConfig(clip_low=1.5)}, "loss.clip_low"),
        ({"loss": {"kl_coef": 0.1}}, "use_reference"),
        ({"device": "tpu"}, "device"),
    ],
)
def test_invalid_field_is_named(overrides, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        LearnerConfig(**overrides)


def test_round_trips_through_a_plain_dict():
    cfg = LearnerConfig(zero_stage=2, betas=[0.9, 0.95], loss={"clip_high": 0.3, "kl_coef": 0.01}, use_reference=True)
    assert cfg.betas == (0.9, 0.95)
    assert isinstance(cfg.loss, PolicyLossConfig) and cfg.loss.clip_high == 0.3
    assert LearnerConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown learner config fields: \\['lrr'\\]"):
        LearnerConfig.from_dict({"lrr": 1.0})


def test_warmup_then_constant():
    cfg = LearnerConfig(warmup_steps=3)
    assert [lr_multiplier(s, cfg) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_warmup_then_cosine_to_the_floor():
    cfg = LearnerConfig(warmup_steps=1, lr_schedule="cosine", total_steps=5, min_lr_ratio=0.1)
    # After warm-up: progress 0, 1/4, 1/2, 3/4, 1, then held at the floor.
    expected = [0.5, 1.0, 0.1 + 0.9 * 0.5 * (1 + 2**-0.5), 0.55, 0.1 + 0.9 * 0.5 * (1 - 2**-0.5), 0.1, 0.1]
    assert [lr_multiplier(s, cfg) for s in range(7)] == pytest.approx(expected)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deepspeed_config(dtype):
    cfg = LearnerConfig(zero_stage=3, dtype=dtype, lr=2e-5, betas=(0.9, 0.95), weight_decay=0.1, grad_clip=0.5)
    ds = build_ds_config(cfg)
    # One micro-batch per DeepSpeed step: the learner owns accumulation (no 1/k scaling).
    assert ds["gradient_accumulation_steps"] == 1 and ds["train_micro_batch_size_per_gpu"] == 1
    assert ds["zero_optimization"] == {"stage": 3}
    assert ds["bf16"] == {"enabled": dtype == "bfloat16"} and ds["fp16"] == {"enabled": False}
    assert ds["gradient_clipping"] == 0.5
    assert ds["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True,
                   "fused": True},
    }
