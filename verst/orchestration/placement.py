"""Placement: one Ray placement group whose bundles hold the trainer ranks and the engines, colocated
(trainer rank i and engine i share bundle i) or disaggregated (each actor has a bundle of its own), then
a teacher's engines (on-policy distillation) and the evaluation fleet's engines in bundles of their own.

On GPU a bundle is one GPU; on CPU it is a fraction of a CPU plus one `SLOT_RESOURCE` unit, so the
same placement logic runs (and fails when it cannot fit) on a 2-core machine. Custom resources
(`cluster.trainer_resources`, `cluster.engine_resources`) pin a role's bundles to the nodes declaring them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Literal

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from verst.orchestration.ray_session import SLOT_RESOURCE

Role = Literal["trainer", "engine", "teacher", "eval"]
PlacementKind = Literal["colocated", "disaggregated"]
# Logical CPUs per bundle. Actors of one bundle split it; real threads are capped separately
# (one torch thread per trainer rank and engine).
CPUS_PER_BUNDLE = 0.5
_BUNDLE_KEY = re.compile(r"^bundle_group_(\d+)_([0-9a-f]+)$")


@dataclasses.dataclass(frozen=True)
class BundlePlan:
    """Which bundle each trainer rank and engine goes to, and what each bundle holds."""

    kind: PlacementKind
    device: Literal["cpu", "cuda"]
    bundles: list[dict[str, float]]
    trainer_bundles: list[int]  # bundle of trainer rank i
    engine_bundles: list[int]  # bundle of engine j
    teacher_bundles: list[int] = dataclasses.field(default_factory=list)  # bundle of teacher engine k
    eval_bundles: list[int] = dataclasses.field(default_factory=list)  # bundle of evaluation engine e
    trainer_resources: dict[str, float] = dataclasses.field(default_factory=dict)  # cluster.trainer_resources
    engine_resources: dict[str, float] = dataclasses.field(default_factory=dict)  # cluster.engine_resources

    def bundles_of(self, role: Role) -> list[int]:
        return {"trainer": self.trainer_bundles, "engine": self.engine_bundles, "teacher": self.teacher_bundles,
                "eval": self.eval_bundles}[role]

    def share(self, role: Role, index: int) -> float:
        """The fraction of its bundle an actor takes: half where a trainer rank and an engine meet."""
        if role in ("teacher", "eval"):
            return 1.0
        bundle = self.bundles_of(role)[index]
        sharing = (bundle in self.trainer_bundles) + (bundle in self.engine_bundles)
        return 1.0 / sharing

    def slots(self) -> int:
        """`SLOT_RESOURCE` units the cluster must offer (CPU placements)."""
        return sum(int(b.get(SLOT_RESOURCE, 0)) for b in self.bundles)

    def cpus(self) -> float:
        return sum(b.get("CPU", 0.0) for b in self.bundles)


def plan_bundles(
    kind: PlacementKind, trainer_ranks: int, num_engines: int, device: Literal["cpu", "cuda"], *,
    teacher_engines: int = 0, eval_engines: int = 0,
    trainer_resources: Mapping[str, float] | None = None, engine_resources: Mapping[str, float] | None = None,
) -> BundlePlan:
    """Colocated: max(N, M) bundles, trainer rank i and engine i in bundle i (Miles' `--colocate`).
    Disaggregated: N + M bundles, trainer ranks first, engines after. M = 0: a trainer-only run (SFT).
    Either way, T teacher engines, then E evaluation engines, get bundles of their own at the end: they
    serve while the trainer and the policy's engines hold theirs. A bundle also asks for the custom
    resources of the roles it holds (a shared bundle: the larger amount of a resource both name; teacher
    and evaluation engines: the engines')."""
    if trainer_ranks < 1:
        raise ValueError(f"cluster.trainer_ranks must be >= 1, got {trainer_ranks}")
    if num_engines < 0:
        raise ValueError(f"cluster.num_engines must be >= 1 (0 for a trainer-only run), got {num_engines}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"placement device must be 'cpu' or 'cuda' (resolve 'auto' first), got {device!r}")
    if kind == "colocated":
        count = max(trainer_ranks, num_engines)
        trainer, engine = list(range(trainer_ranks)), list(range(num_engines))
    elif kind == "disaggregated":
        count = trainer_ranks + num_engines
        trainer, engine = list(range(trainer_ranks)), list(range(trainer_ranks, count))
    else:
        raise ValueError(f"cluster.placement = {kind!r} is not 'colocated' or 'disaggregated'")
    if teacher_engines < 0:
        raise ValueError(f"teacher.num_engines must be >= 1 (0 without a teacher), got {teacher_engines}")
    if eval_engines < 0:
        raise ValueError(f"eval.num_engines must be >= 0, got {eval_engines}")
    teacher = list(range(count, count + teacher_engines))
    evaluation = list(range(count + teacher_engines, count + teacher_engines + eval_engines))
    unit = {"GPU": 1.0} if device == "cuda" else {SLOT_RESOURCE: 1.0}
    trainer_resources = {key: float(amount) for key, amount in (trainer_resources or {}).items()}
    engine_resources = {key: float(amount) for key, amount in (engine_resources or {}).items()}
    bundles = []
    for index in range(count + teacher_engines + eval_engines):
        bundle = {"CPU": CPUS_PER_BUNDLE, **unit}
        held_by_engine = index in engine or index in teacher or index in evaluation
        for held, custom in ((index in trainer, trainer_resources), (held_by_engine, engine_resources)):
            for key, amount in custom.items() if held else ():
                bundle[key] = max(bundle.get(key, 0.0), float(amount))
        bundles.append(bundle)
    return BundlePlan(kind, device, bundles, trainer, engine, teacher, evaluation, trainer_resources,
                      engine_resources)


class Placement:
    """A created placement group for a `BundlePlan`; `actor_options` places one actor in its bundle."""

    def __init__(self, plan: BundlePlan, group: PlacementGroup):
        self.plan, self.group = plan, group
        self._removed = False

    @classmethod
    def create(cls, plan: BundlePlan, timeout_s: float = 60.0) -> Placement:
        """Reserve the bundles (PACK: as few nodes as possible); fails loudly when they do not fit."""
        group = placement_group(plan.bundles, strategy="PACK", name="")
        ready, _ = ray.wait([group.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(group)
            shapes = [dict(t) for t in dict.fromkeys(tuple(sorted(b.items())) for b in plan.bundles)]
            raise TimeoutError(
                f"placement group of {len(plan.bundles)} bundles {shapes} ({plan.kind}, "
                f"{len(plan.trainer_bundles)} trainer ranks, {len(plan.engine_bundles)} engines, "
                f"{len(plan.teacher_bundles)} teacher engines, {len(plan.eval_bundles)} evaluation engines) not placed "
                f"within {timeout_s:g}s; the cluster offers {ray.cluster_resources()}, of which "
                f"{ray.available_resources()} are free"
                + (f" (a CPU placement needs the custom resource {SLOT_RESOURCE!r} declared on the "
                   "nodes, e.g. `ray start --resources '{\"verst_slot\": 8}'`)" if plan.device == "cpu" else "")
            )
        return cls(plan, group)

    def bundle_nodes(self) -> list[str]:
        """The Ray node id each bundle was placed on, by bundle index."""
        from ray.util import placement_group_table

        placed = placement_group_table(self.group)["bundles_to_node_id"]
        return [placed[index] for index in range(len(self.plan.bundles))]

    def nodes_of(self, role: Role) -> list[str]:
        """The node id of each trainer rank (or engine), by index: where its bundle was placed."""
        nodes = self.bundle_nodes()
        return [nodes[bundle] for bundle in (self.plan.trainer_bundles if role == "trainer" else self.plan.engine_bundles)]

    def bundle_of(self, role: Role, index: int) -> int:
        return self.plan.bundles_of(role)[index]

    def actor_options(self, role: Role, index: int) -> dict[str, Any]:
        """`.options(...)` for actor `index` of `role`: its share of its bundle, scheduled into it."""
        share = self.plan.share(role, index)
        options: dict[str, Any] = {
            "num_cpus": CPUS_PER_BUNDLE * share,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=self.bundle_of(role, index)
            ),
        }
        if self.plan.device == "cuda":
            # Colocated: two actors at 0.5 GPU see the same device (Ray sets CUDA_VISIBLE_DEVICES).
            options["num_gpus"] = share
        else:
            options["resources"] = {SLOT_RESOURCE: share}
        return options

    def remove(self) -> None:
        if self._removed:
            return
        self._removed = True
        if ray.is_initialized():
            remove_placement_group(self.group)

    @property
    def id(self) -> str:
        return self.group.id.hex()


def current_bundle() -> tuple[str, int]:
    """Inside an actor: (placement group id, bundle index) it was scheduled into.

    Read from the bundle-scoped resources Ray assigned (`bundle_group_<i>_<pg id>`): the ground truth,
    not what the actor was asked to do.
    """
    from ray._private.worker import global_worker

    for key in global_worker.core_worker.resource_ids():
        match = _BUNDLE_KEY.match(key)
        if match:
            return match.group(2), int(match.group(1))
    raise RuntimeError("this actor was not scheduled into a placement group bundle")
