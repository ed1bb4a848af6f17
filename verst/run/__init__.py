"""Layer 4.0: an RL run as a composition of parts (rollouts, trainer group, weight push, evaluator,
checkpointer, monitor), the named steps its loops call, and how it starts. Names resolve lazily.
"""

from __future__ import annotations

from verst.config.imports import lazy_exports

_EXPORTS = {
    "RLRun": "verst.run.rl_run",
    "open_rl_run": "verst.run.start",
    "RunOpener": "verst.run.start",
    "run_restarting": "verst.run.restarts",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
