"""Layer 3: Ray placement groups, trainer and engine actor groups, and the rollout manager actor —
the only Ray-aware package besides `schedules`. Names resolve lazily (importing this imports no Ray).
"""

from __future__ import annotations

from verst.config.imports import lazy_exports

_EXPORTS = {
    "Orchestration": "verst.orchestration.cluster",
    "RolloutManagerHandle": "verst.orchestration.cluster",
    "EngineActorGroup": "verst.orchestration.engine_actors",
    "EngineMemory": "verst.orchestration.handles",
    "RolloutSource": "verst.orchestration.handles",
    "TrainBatchRef": "verst.orchestration.handles",
    "WeightSyncHandle": "verst.orchestration.handles",
    "check_engine_type": "verst.orchestration.engine_actors",
    "BundlePlan": "verst.orchestration.placement",
    "Placement": "verst.orchestration.placement",
    "plan_bundles": "verst.orchestration.placement",
    "RaySession": "verst.orchestration.ray_session",
    "SLOT_RESOURCE": "verst.orchestration.ray_session",
    "TrainerActorGroup": "verst.orchestration.trainer_actors",
    "TrainerWeightSync": "verst.orchestration.weight_sync",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
