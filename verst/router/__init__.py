"""sglang-router in front of the engines (`RouterManager`); the direct fan-out to every engine is
`verst.inference_client.EngineFleet`."""

from verst.router.manager import RouterManager

__all__ = ["RouterManager"]
