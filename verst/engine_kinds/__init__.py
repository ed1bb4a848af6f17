"""The engine seam: what the rollout side and the weight syncer need from an inference server
(`EngineAPI`), and one kind per server (embedded, vLLM, SGLang) that launches it and maps that API to it.
"""

from verst.config.registries import ENGINE_KINDS
from verst.engine_kinds.api import EngineAPI
from verst.engine_kinds.kinds import EngineKind, engine_kind

# `@register_engine_kind("name", transports=(...), ...)` over an `EngineKind`, in a module `plugins` lists.
register_engine_kind = ENGINE_KINDS.register

__all__ = ["EngineAPI", "EngineKind", "engine_kind", "register_engine_kind"]
