"""Layer 2: rollout — the data buffer, group filters and the fully async background worker."""

from verst.rollout.buffer import (
    DataBuffer,
    DiscardReason,
    FifoBuffer,
    OnDiscard,
    build_buffer,
    buffer_capacity,
    discard_handler,
    is_unusable,
)
from verst.rollout.filters import FILTERS, GroupFilter, ZeroStdFilter, apply_filter, build_filter, filter_metrics
from verst.rollout.worker import (
    GENERATE_ERROR_KEY,
    AsyncRolloutWorker,
    FinishGroup,
    GenerateGroup,
    GenerateSample,
    GroupSource,
)

__all__ = [
    "FILTERS",
    "GENERATE_ERROR_KEY",
    "AsyncRolloutWorker",
    "DataBuffer",
    "DiscardReason",
    "FifoBuffer",
    "FinishGroup",
    "GenerateGroup",
    "GenerateSample",
    "GroupFilter",
    "GroupSource",
    "OnDiscard",
    "ZeroStdFilter",
    "apply_filter",
    "buffer_capacity",
    "build_buffer",
    "build_filter",
    "discard_handler",
    "filter_metrics",
    "is_unusable",
]
