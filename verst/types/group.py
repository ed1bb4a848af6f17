"""Groups: all samples of one prompt, scheduled, buffered and dropped as a unit."""

from __future__ import annotations

import copy
import pickle

from verst.types.sample import Sample, SampleError, Status

Group = list[Sample]


def expand_group(prompt: Sample, n: int, group_index: int, first_index: int) -> Group:
    """n independent copies of a prompt sample, numbered `first_index`.. within `group_index`."""
    if n < 1:
        raise SampleError(f"expand_group: n_samples_per_prompt must be >= 1, got {n}")
    copies = _deep_copies(prompt, n)
    for i, s in enumerate(copies):
        s.group_index, s.index = group_index, first_index + i
    return copies


def _deep_copies(prompt: Sample, n: int) -> list[Sample]:
    """n deep copies of `prompt`: encoded once and decoded n times (a third of `copy.deepcopy`'s time on a
    prompt sample); by `copy.deepcopy` when stdlib pickle cannot encode what its metadata holds."""
    try:
        encoded = pickle.dumps(prompt, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        return [copy.deepcopy(prompt) for _ in range(n)]
    return [pickle.loads(encoded) for _ in range(n)]


def group_oldest_version(group: Group) -> int | None:
    """The oldest weight version of any token in the group (None if no engine call recorded)."""
    versions = [v for s in group if (v := s.oldest_weight_version()) is not None]
    return min(versions) if versions else None


def group_staleness(group: Group, current_version: int) -> int:
    """Current trainer version minus the oldest version of any token in the group (pessimistic)."""
    oldest = group_oldest_version(group)
    if oldest is None:
        raise SampleError(f"group {group[0].group_index if group else '?'}: no weight versions recorded")
    return current_version - oldest


def group_is_aborted(group: Group) -> bool:
    """Generation gave up on the group: a sample is aborted, failed (e.g. reward error) or still pending."""
    return any(s.status in (Status.ABORTED, Status.FAILED, Status.PENDING) for s in group)


def group_rewards(group: Group, key: str | None = None) -> list[float]:
    return [s.reward_value(key) for s in group]
