"""The run configuration: ``schema`` (the dataclasses, every key and default) and ``load`` (YAML +
overrides -> checked config). Nothing here imports the model side of shardlm."""

from shardlm.config.load import apply_overrides, load_config, validate
from shardlm.config.schema import (
    SCHEDULERS,
    Config,
    DataConfig,
    EvalConfig,
    LoraConfig,
    ParallelConfig,
    TrainConfig,
)

__all__ = [
    "SCHEDULERS",
    "Config",
    "DataConfig",
    "EvalConfig",
    "LoraConfig",
    "ParallelConfig",
    "TrainConfig",
    "apply_overrides",
    "load_config",
    "validate",
]
