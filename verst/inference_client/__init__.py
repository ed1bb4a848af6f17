"""What every caller of an engine needs: the async client and its request batching, the wire protocol,
the fan-out to every engine, the weight wire formats and port helpers. Imports no torch; names resolve lazily.
"""

from __future__ import annotations

from verst.config.imports import lazy_exports

_EXPORTS = {
    "EngineClient": "verst.inference_client.client",
    "EngineError": "verst.inference_client.client",
    "GenerateResult": "verst.inference_client.client",
    "RoutingKeyError": "verst.inference_client.client",
    "Timeouts": "verst.inference_client.client",
    "ROUTING_KEY_HEADER": "verst.inference_client.client",
    "RequestBatcher": "verst.inference_client.batching",
    "InvalidRequest": "verst.inference_client.protocol",
    "SamplingParams": "verst.inference_client.protocol",
    "EngineFleet": "verst.inference_client.fleet",
    "FleetError": "verst.inference_client.fleet",
    "IdleMeter": "verst.inference_client.fleet",
    "free_port": "verst.inference_client.ports",
    "wait_healthy": "verst.inference_client.ports",
    "serialize_named_tensors": "verst.inference_client.tensor_payload",
    "open_weight_update_group": "verst.inference_client.weights",
    "broadcast_tensors": "verst.inference_client.weights",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
