"""Layer 0: the Sample record, its status, group helpers and the binary codec."""

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

__all__ = [
    "Group",
    "Sample",
    "SampleError",
    "Status",
    "decode_samples",
    "encode_samples",
    "expand_group",
    "group_is_aborted",
    "group_oldest_version",
    "group_rewards",
    "group_staleness",
]
