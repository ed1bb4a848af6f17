"""Whether a `BundlePlan` can ever fit the Ray cluster's nodes: checked against each node's total
resources before the placement group is created, so an impossible placement is refused by field name.

A placement that fits on paper but not now (other jobs hold the resources) is left to the placement
group's own timeout (`Placement.create`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from verst.orchestration.placement import BundlePlan
from verst.orchestration.ray_session import SLOT_RESOURCE

_EPS = 1e-9


@dataclasses.dataclass(frozen=True)
class NodeOffer:
    """One alive Ray node: its id, address and total logical resources."""

    node_id: str
    address: str
    resources: dict[str, float]

    def holds(self, bundle: dict[str, float]) -> int:
        """How many bundles of this shape the node's totals hold."""
        return min(math.floor(self.resources.get(key, 0.0) / amount + _EPS) for key, amount in bundle.items())

    def describe(self) -> str:
        custom = {k: v for k, v in sorted(self.resources.items())
                  if k not in ("memory", "object_store_memory") and not k.startswith("node:")}
        return f"node {self.node_id[:8]} ({self.address}) {custom}"


class PlacementRefused(ValueError):
    """The plan cannot fit the cluster's nodes, whatever else runs there."""


def ray_nodes() -> list[NodeOffer]:
    """The alive nodes of the connected Ray cluster."""
    import ray

    return [NodeOffer(n["NodeID"], n["NodeManagerAddress"], dict(n["Resources"])) for n in ray.nodes() if n["Alive"]]


def check_fits(plan: BundlePlan, nodes: Iterable[NodeOffer]) -> None:
    """Raise `PlacementRefused`, naming the config fields, when no assignment of the plan's bundles to
    `nodes` can exist: a bundle no node holds, more bundles of one kind than the nodes holding that kind
    can take, or more of one resource than the whole cluster has."""
    nodes = list(nodes)
    offered = "; ".join(node.describe() for node in nodes) or "no alive node"
    for shape, indices in _shapes(plan).items():
        bundle = dict(shape)
        who = _holders(plan, indices)
        eligible = [node for node in nodes if node.holds(bundle) > 0]
        if not eligible:
            raise PlacementRefused(f"{who} ask each for {bundle}, which no node of the Ray cluster offers: "
                                   f"{_missing(plan, bundle, nodes)}. The nodes: {offered}")
        room = sum(node.holds(bundle) for node in eligible)
        if room < len(indices):
            raise PlacementRefused(
                f"{who} need {len(indices)} bundles of {bundle}, but the nodes that hold one take {room} in all "
                f"({'; '.join(node.describe() for node in eligible)}); lower {_count_fields(plan, indices)} or "
                "give those nodes more of these resources")
    for key in sorted({key for bundle in plan.bundles for key in bundle}):
        need = sum(bundle.get(key, 0.0) for bundle in plan.bundles)
        have = sum(node.resources.get(key, 0.0) for node in nodes)
        if need > have + _EPS:
            raise PlacementRefused(
                f"the placement needs {need:g} {key!r} in all ({len(plan.trainer_bundles)} trainer ranks, "
                f"{len(plan.engine_bundles)} engines, {len(plan.teacher_bundles)} teacher engines "
                f"(teacher.num_engines), {len(plan.eval_bundles)} evaluation engines (eval.num_engines), "
                f"cluster.placement = {plan.kind!r}) but the Ray cluster has "
                f"{have:g}{_slot_hint(key)}. The nodes: {offered}")


def _shapes(plan: BundlePlan) -> dict[tuple[tuple[str, float], ...], list[int]]:
    shapes: dict[tuple[tuple[str, float], ...], list[int]] = {}
    for index, bundle in enumerate(plan.bundles):
        shapes.setdefault(tuple(sorted(bundle.items())), []).append(index)
    return shapes


def _roles(plan: BundlePlan, indices: list[int]) -> tuple[bool, bool, bool, bool]:
    return tuple(any(i in bundles for i in indices)
                 for bundles in (plan.trainer_bundles, plan.engine_bundles, plan.teacher_bundles, plan.eval_bundles))


def _holders(plan: BundlePlan, indices: list[int]) -> str:
    if any(i in plan.trainer_bundles and i in plan.engine_bundles for i in indices):
        return "the bundles shared by a trainer rank and an engine (cluster.placement = 'colocated')"
    trainer, engine, teacher, evaluation = _roles(plan, indices)
    return " and ".join(name for name, used in (("the trainer ranks", trainer), ("the engines", engine),
                                                ("the teacher engines", teacher),
                                                ("the evaluation engines", evaluation)) if used)


def _count_fields(plan: BundlePlan, indices: list[int]) -> str:
    trainer, engine, teacher, evaluation = _roles(plan, indices)
    return " / ".join(name for name, used in (("cluster.trainer_ranks", trainer), ("cluster.num_engines", engine),
                                              ("teacher.num_engines", teacher), ("eval.num_engines", evaluation))
                      if used)


def _missing(plan: BundlePlan, bundle: dict[str, float], nodes: list[NodeOffer]) -> str:
    """Why no node holds `bundle`, by the field that asked for what is missing."""
    lacking = [key for key in bundle if not any(n.resources.get(key, 0.0) + _EPS >= bundle[key] for n in nodes)]
    if not lacking:
        return "each resource is on some node, but no node has them all together" + (
            " (colocated, a trainer rank and an engine share a node: cluster.trainer_resources and "
            "cluster.engine_resources must both be on it)" if plan.kind == "colocated" else "")
    reasons = []
    for key in lacking:
        fields = [f"cluster.{role}_resources = {resources}" for role, resources in
                  (("trainer", plan.trainer_resources), ("engine", plan.engine_resources)) if key in resources]
        if fields:
            reasons.append(f"{key!r} ({' and '.join(fields)})")
        elif key == "GPU":
            reasons.append("'GPU' (cluster.device = 'cuda': no node has a whole GPU)")
        else:
            reasons.append(f"{key!r}{_slot_hint(key)}")
    return "no node has " + ", ".join(reasons)


def _slot_hint(key: str) -> str:
    if key != SLOT_RESOURCE:
        return ""
    return (f" (a CPU placement takes one {SLOT_RESOURCE!r} per bundle: declare them on the nodes, e.g. "
            f"`ray start ... --resources '{{\"{SLOT_RESOURCE}\": 4}}'`)")

