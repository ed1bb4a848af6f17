"""The embedded inference engine: continuous batching over any HF causal LM, served in SGLang's HTTP
dialect. Importing this package imports no torch; names resolve lazily.
"""

from __future__ import annotations

from verst.config.imports import lazy_exports

_EXPORTS = {
    "EngineConfig": "verst.engine.config",
    "EngineCore": "verst.engine.core",
    "EngineRunner": "verst.engine.runner",
    "EngineProcess": "verst.engine.process",
    "BackgroundServer": "verst.engine.process",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
