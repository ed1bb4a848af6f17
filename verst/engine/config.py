"""The engine's settings: scheduler limits, prefix caching, the model's forward, priority preemption.
Apart from the core so that processes which only configure an engine need not import torch."""

from __future__ import annotations

import dataclasses

from verst.config.schema import MODEL_IMPLS as IMPLS  # EngineConfig.model_impl: see verst.engine.model_runner


@dataclasses.dataclass
class EngineConfig:
    """Scheduler limits. The defaults suit tiny and small models on a CPU."""

    max_running_requests: int = 64
    max_prefill_tokens: int = 8192  # rows x longest pending prompt in one prefill forward
    # While requests are running, admit new ones only once this many slots are free (or the whole queue
    # fits): a prefill forward costs about as much as a decode step, so admitting one request per step
    # nearly doubles the forwards. None: max_running_requests // 8.
    min_prefill_batch: int | None = None
    context_length: int | None = None  # default: the model's max_position_embeddings
    prefix_cache_tokens: int = 32768  # 0 disables prefix caching
    return_routed_experts: bool = False  # MoE: return routed experts on every reply (the router drops the field)
    seed: int = 0  # seed of the sampling generator used by requests without sampling_seed
    # The model's forward: "native" (verst.engine.native, dense Llama-family), "transformers", or "auto"
    # (native where it applies). SGLang and vLLM call this choice model_impl too.
    model_impl: str = "auto"
    # A waiting request of a higher priority than running ones takes their slots: they go back to the
    # queue (their KV offered to the prefix cache) and continue later, as SGLang's priority preemption.
    priority_preemption: bool = True
    # LoRA adapters resident at once (SGLang's max_loaded_loras); the base model is always served besides.
    max_loaded_loras: int = 8
    # True on-policy: a finished request's logprobs are recomputed by the trainer's forward over the whole
    # sequence alone (`verst.models.scoring`), so they equal the trainer's bit for bit. CPU float32 native only.
    true_on_policy: bool = False

    def __post_init__(self) -> None:
        if self.min_prefill_batch is None:
            self.min_prefill_batch = max(1, self.max_running_requests // 8)
        for name in ("max_running_requests", "max_prefill_tokens", "min_prefill_batch", "max_loaded_loras"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.model_impl not in IMPLS:
            raise ValueError(f"EngineConfig.model_impl must be one of {list(IMPLS)}, got {self.model_impl!r}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"EngineConfig.context_length must be >= 2, got {self.context_length}")
