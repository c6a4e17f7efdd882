"""Typed configuration of a training run, loaded from the Hydra tree in `conf/`."""
from specroll.telemetry.config import LoggerSection

from .sections import ClusterSection, DataSection, EvalSection, ModelSection, RolloutSection
from .train import TrainConfig, check_paths, load_train_config, validate_against_model
from .typed import build_dataclass

__all__ = [
    "ClusterSection",
    "DataSection",
    "LoggerSection",
    "ModelSection",
    "RolloutSection",
    "TrainConfig",
    "build_dataclass",
    "check_paths",
    "load_train_config",
    "validate_against_model",
]
