"""Layer 2: session — the token-in-token-out session server. `SessionManager` owns multi-turn trajectories
(exact engine ids, only new messages tokenized, mismatch metrics); `SessionServer` serves it over HTTP.
Importing this package imports nothing heavy; names resolve lazily.
"""

from __future__ import annotations

from verst.config.imports import lazy_exports

_EXPORTS = {
    "SessionError": "verst.session.errors",
    "SessionManager": "verst.session.manager",
    "SessionServer": "verst.session.http",
    "build_app": "verst.session.http",
    "Trajectory": "verst.session.assemble",
    "Turn": "verst.session.assemble",
    "assemble": "verst.session.assemble",
    "ChatTemplate": "verst.session.tito",
    "Mismatch": "verst.session.tito",
    "MISMATCH_TYPES": "verst.session.tito",
    "compare_ids": "verst.session.tito",
    "mismatch_rates": "verst.session.tito",
    "parse_reply": "verst.session.messages",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
