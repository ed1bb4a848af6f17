"""Groups: all samples of one prompt, scheduled, buffered and dropped as a unit."""

from __future__ import annotations

import copy
from typing import Any

from verst.types.sample import FIELD_NAMES, Sample, SampleError, Status

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
    """n deep copies of `prompt`: its lists and dicts are copied and its strings and numbers shared, as
    `copy.deepcopy` does, in a third of its time; what else its metadata or label holds goes through
    `copy.deepcopy`. The rollout side holds the copies while the group generates (docs/scale.md), so they
    share what they can."""
    fields = [(name, getattr(prompt, name)) for name in FIELD_NAMES]
    return [Sample(**{name: _copy_tree(value) for name, value in fields}) for _ in range(n)]


_ATOMS = frozenset((str, int, float, bool, type(None), Status))  # immutable: copies share them


def _copy_tree(value: Any) -> Any:
    """A deep copy of JSON-like data (dicts, lists, strings, numbers) sharing its immutable leaves; any other
    type by `copy.deepcopy`. Unlike `copy.deepcopy`, two references to one list become two lists."""
    kind = type(value)
    if kind in _ATOMS:
        return value
    if kind is dict:
        return {k: _copy_tree(v) for k, v in value.items()}
    if kind is list:
        return [_copy_tree(v) for v in value]
    return copy.deepcopy(value)


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
