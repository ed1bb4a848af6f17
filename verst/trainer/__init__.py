"""Layer 2: training backends behind the `TrainBackend` contract (FSDP2 first); algorithm-agnostic
(losses come in as `loss_fn` callables). Their ranks are started by `verst.orchestration`.

Importing this package imports no torch; names resolve lazily, so driver-side code (rank handles,
transports' types) stays light.
"""

from __future__ import annotations

from verst.config.imports import lazy_exports

_EXPORTS = {
    "Batch": "verst.trainer.backend",
    "CollectiveCalls": "verst.trainer.backend",
    "InProcessRank": "verst.trainer.backend",
    "RankError": "verst.trainer.backend",
    "TrainBackend": "verst.trainer.backend",
    "TrainerRanks": "verst.trainer.backend",
    "fsdp2_backend": "verst.trainer.factory",
    "diffusion_backend": "verst.trainer.factory",
    "DiffusionBackend": "verst.trainer.diffusion_backend",
    "ForwardOutputs": "verst.trainer.batching",
    "MicroBatch": "verst.trainer.batching",
    "FSDP2Backend": "verst.trainer.fsdp",
    "ROLLOUT_LOGPROBS": "verst.trainer.items",
    "TrainItem": "verst.trainer.items",
    "TrainItemError": "verst.trainer.items",
    "as_items": "verst.trainer.items",
    "make_items": "verst.trainer.items",
    "LossFn": "verst.trainer.losses",
    "Normalizer": "verst.trainer.losses",
    "count_policy_sequences": "verst.trainer.losses",
    "count_policy_tokens": "verst.trainer.losses",
    "sft_loss_fn": "verst.trainer.losses",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
