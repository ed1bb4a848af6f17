"""Layer 2: training backends behind the `TrainBackend` contract (FSDP2 first) and the launcher
that starts their ranks; algorithm-agnostic (losses come in as `loss_fn` callables).
"""

from verst.trainer.backend import Batch, TrainBackend, WeightBucket
from verst.trainer.batching import ForwardOutputs, MicroBatch
from verst.trainer.fsdp import FSDP2Backend
from verst.trainer.items import ROLLOUT_LOGPROBS, TrainItem, TrainItemError, as_items, make_items
from verst.trainer.launcher import RankError, TrainerGroup
from verst.trainer.losses import LossFn, Normalizer, count_policy_sequences, count_policy_tokens, sft_loss_fn

__all__ = [
    "ROLLOUT_LOGPROBS",
    "Batch",
    "FSDP2Backend",
    "ForwardOutputs",
    "LossFn",
    "MicroBatch",
    "Normalizer",
    "RankError",
    "TrainBackend",
    "TrainItem",
    "TrainItemError",
    "TrainerGroup",
    "WeightBucket",
    "as_items",
    "count_policy_sequences",
    "count_policy_tokens",
    "make_items",
    "sft_loss_fn",
]
