"""Typed configuration of a training run, loaded from the Hydra tree in `conf/`."""
from specroll.models import ModelConfig
from specroll.telemetry.config import LoggerConfig

from .sections import ClusterConfig, DataConfig, DynamicSamplingConfig, EvalConfig, RolloutConfig
from .train_config import TrainConfig, check_paths, load_train_config, validate_against_model
from .typed import build_dataclass

__all__ = [
    "ClusterConfig",
    "DataConfig",
    "DynamicSamplingConfig",
    "EvalConfig",
    "LoggerConfig",
    "ModelConfig",
    "RolloutConfig",
    "TrainConfig",
    "build_dataclass",
    "check_paths",
    "load_train_config",
    "validate_against_model",
]
