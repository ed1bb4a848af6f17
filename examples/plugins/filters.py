"""A group filter (`rollout.dynamic_filter`): `(group) -> bool`, True keeps the group. It runs inside the
buffer's `put` on the event loop, so it is quick, does not block and does not modify the group.

    [rollout]
    dynamic_filter = "examples.plugins.filters:no_truncated"
"""

from __future__ import annotations

from verst.types import Group, Status


def no_truncated(group: Group) -> bool:
    """Drop a group when any of its samples hit the response or context limit."""
    return all(s.status is not Status.TRUNCATED for s in group)
