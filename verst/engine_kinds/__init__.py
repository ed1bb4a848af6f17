"""The engine seam: what the rollout side and the weight syncer need from an inference server
(`EngineAPI`), and one kind per server (embedded, vLLM, SGLang) that launches it and maps that API to it.
"""

from verst.engine_kinds.api import EngineAPI
from verst.engine_kinds.kinds import ENGINE_KINDS, EngineKind, engine_kind

__all__ = ["ENGINE_KINDS", "EngineAPI", "EngineKind", "engine_kind"]
