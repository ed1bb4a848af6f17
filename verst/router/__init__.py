"""sglang-router in front of the engines (`RouterManager`) and direct fan-out to every engine (`EngineFleet`)."""

from verst.router.fleet import EngineFleet, FleetError
from verst.router.manager import RouterManager

__all__ = ["EngineFleet", "FleetError", "RouterManager"]
