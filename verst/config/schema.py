"""The typed config tree: one pydantic model per concern (`inputs`, `training`, `runtime`), a doc line and a
range on every field, gathered here into `VerstConfig`.

Defaults live in the sections and nowhere else. Names that select an implementation are checked against their
registries (`registries`); the rules that tie fields together (batch arithmetic, schedule vs placement, what
an engine can take) live in `rules`, one function each. Importing this module never imports torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from verst.config.imports import import_plugins
from verst.config.inputs import (
    DataConfig,
    DiffusionConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    SamplingConfig,
    SandboxConfig,
)
from verst.config.rules import check_rules
from verst.config.runtime import (
    BufferConfig,
    CheckpointConfig,
    ClusterConfig,
    EvalConfig,
    FaultConfig,
    LoggingConfig,
    SyncConfig,
    TeacherConfig,
)
from verst.config.section import MODEL_IMPLS, RESERVED_RESOURCES, ModelImpl, Section
from verst.config.training import (
    AlgorithmConfig,
    CriticConfig,
    LoraAdapterConfig,
    LoraConfig,
    SFTConfig,
    TrainerConfig,
)

__all__ = [
    "MODEL_IMPLS", "RESERVED_RESOURCES", "AlgorithmConfig", "BufferConfig", "CheckpointConfig", "ClusterConfig",
    "CriticConfig", "DataConfig", "DiffusionConfig", "EvalConfig", "FaultConfig", "LoggingConfig", "LoraAdapterConfig", "LoraConfig",
    "ModelConfig", "ModelImpl", "RewardConfig", "RolloutConfig", "SFTConfig", "SamplingConfig", "SandboxConfig", "Section",
    "SyncConfig", "TeacherConfig", "TrainerConfig", "VerstConfig",
]

Schedule = Literal["sync", "one_step_off", "fully_async"]
# A value of an engine's pass-through flag (`[vllm]`, `[sglang]`): true is the bare flag, a list gives each.
EngineFlag = str | int | float | bool | list[str | int | float]


class VerstConfig(Section):
    """A run's whole configuration. `plugins` are imported before anything else is checked: the names they
    register (`verst.config.registries`) are then valid values of the fields that name one."""

    plugins: list[str] = Field(
        default_factory=list, description="Modules imported first, in every process of the run (the driver, the "
        "trainer ranks, the rollout manager): where you register estimators, losses, corrections, rewards, engine "
        "kinds or transports of your own (docs/plugins.md).")
    name: str = Field("run", min_length=1, description="Run name; the run directory is runs/<name> by default.")
    run_dir: str | None = Field(None, description="Run directory; default runs/<name>.")
    overwrite: bool = Field(False, description="Empty an existing, non-empty run directory first; without it "
                            "such a directory is refused, so two runs never mix their files.")
    schedule: Schedule = Field("sync", description="RL schedule: sync, one_step_off or fully_async.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt data.")
    diffusion: DiffusionConfig = Field(default_factory=DiffusionConfig, description="The image sampler "
                                       "(model.kind = 'diffusion').")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout volume and sampling.")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="Sandboxes for the agent's tools.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward function.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantages and losses.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="Optimizer and batching.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters (off: full fine-tuning).")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="PPO's value model.")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="Supervised fine-tuning.")
    sync: SyncConfig = Field(default_factory=SyncConfig, description="Weight synchronisation.")
    buffer: BufferConfig = Field(default_factory=BufferConfig, description="Data buffer.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Placement and process counts.")
    teacher: TeacherConfig = Field(default_factory=TeacherConfig, description="On-policy distillation's teacher.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Metrics sinks.")
    fault: FaultConfig = Field(default_factory=FaultConfig, description="Hang limits; engine and trainer restarts.")
    vllm: dict[str, EngineFlag] = Field(
        default_factory=dict, description="vLLM server flags, passed unchanged (`--vllm.max-num-seqs 64` is "
        "`--max-num-seqs 64`; true: the bare flag). cluster.engine = 'vllm' only.")
    sglang: dict[str, EngineFlag] = Field(
        default_factory=dict, description="SGLang server flags, passed unchanged (`--sglang.mem-fraction-static "
        "0.7`; true: the bare flag). cluster.engine = 'sglang' only.")

    @model_validator(mode="before")
    @classmethod
    def _plugins_first(cls, data: Any) -> Any:
        """The plug-in modules register their names before any field naming one is checked."""
        if isinstance(data, dict):
            import_plugins(data.get("plugins") or [])
        return data

    @model_validator(mode="after")
    def _rules(self) -> VerstConfig:
        check_rules(self)
        return self
