"""Layer 0: the Sample record, its status, group helpers, the binary codec and the weight-sync bucket type."""

from verst.types.codec import decode_samples, encode_samples
from verst.types.group import (
    Group,
    expand_group,
    group_is_aborted,
    group_oldest_version,
    group_rewards,
    group_staleness,
)
from verst.types.sample import Sample, SampleError, Status
from verst.types.weights import WeightBucket

__all__ = [
    "Group",
    "Sample",
    "SampleError",
    "Status",
    "WeightBucket",
    "decode_samples",
    "encode_samples",
    "expand_group",
    "group_is_aborted",
    "group_oldest_version",
    "group_rewards",
    "group_staleness",
]
