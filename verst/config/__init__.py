"""Layer 0: the typed config tree, recipe loading with dotted overrides, and batch arithmetic."""

from verst.config.arithmetic import BatchPlan, batch_plan
from verst.config.imports import ImportPathError, load_object
from verst.config.load import ConfigError, iter_fields, load_config, parse_overrides, read_recipe
from verst.config.schema import (
    AlgorithmConfig,
    BufferConfig,
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    EvalConfig,
    FaultConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    SamplingConfig,
    SFTConfig,
    SyncConfig,
    TrainerConfig,
    VerstConfig,
)

__all__ = [
    "AlgorithmConfig",
    "BatchPlan",
    "BufferConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "ConfigError",
    "ImportPathError",
    "DataConfig",
    "EvalConfig",
    "FaultConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "RewardConfig",
    "RolloutConfig",
    "SFTConfig",
    "SamplingConfig",
    "SyncConfig",
    "TrainerConfig",
    "VerstConfig",
    "batch_plan",
    "iter_fields",
    "load_config",
    "load_object",
    "parse_overrides",
    "read_recipe",
]
