"""The embedded inference engine (continuous batching over any HF causal LM, SGLang's HTTP dialect) and
the async engine client. Importing this package imports no torch; names resolve lazily.
"""

from __future__ import annotations

from verst.config.imports import lazy_exports

_EXPORTS = {
    "EngineClient": "verst.engine.client",
    "EngineError": "verst.engine.client",
    "GenerateResult": "verst.engine.client",
    "RoutingKeyError": "verst.engine.client",
    "Timeouts": "verst.engine.client",
    "ROUTING_KEY_HEADER": "verst.engine.client",
    "EngineConfig": "verst.engine.config",
    "EngineCore": "verst.engine.core",
    "EngineRunner": "verst.engine.runner",
    "EngineProcess": "verst.engine.process",
    "free_port": "verst.engine.process",
    "write_shm_bucket": "verst.engine.weights",
    "open_weight_update_group": "verst.engine.weights",
    "broadcast_tensors": "verst.engine.weights",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
