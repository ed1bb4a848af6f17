"""Weight synchronisation from the trainer to the engines: three bucketed transports behind one small
interface, and the one place that runs the pause → flush → push → version → continue lifecycle.

Importing this package imports no torch; names resolve lazily.
"""

from __future__ import annotations

from verst.config.imports import lazy_exports

_EXPORTS = {
    "WeightTransport": "verst.sync.transport",
    "TransportOptions": "verst.sync.transport",
    "AdapterSpec": "verst.sync.transport",
    "DistributedTransport": "verst.sync.distributed",
    "TensorTransport": "verst.sync.tensor",
    "DiskTransport": "verst.sync.disk",
    "SnapshotWriter": "verst.sync.disk",
    "list_snapshots": "verst.sync.disk",
    "WeightSyncer": "verst.sync.syncer",
    "VersionError": "verst.sync.syncer",
    "WeightSyncError": "verst.sync.syncer",
    "LogprobChecker": "verst.sync.check",
    "WeightCheckError": "verst.sync.check",
    "build_transport": "verst.sync.factory",
    "build_syncer": "verst.sync.factory",
    "rebucket": "verst.sync.buckets",
}

__all__ = sorted([*_EXPORTS, "register_transport"])


def register_transport(name: str, doc: str = "", **traits):
    """`@register_transport("name", same_machine=..., keeps_snapshots=...)` over a `WeightTransport` class with a
    `build(fleet, options)` classmethod, in a module that the config's `plugins` lists."""
    from verst.config.registries import WEIGHT_TRANSPORTS

    return WEIGHT_TRANSPORTS.register(name, doc, **traits)

__getattr__ = lazy_exports(__name__, _EXPORTS)
