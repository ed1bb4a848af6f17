"""The simulation's engine kind and weight transport as registry entries (`cluster.engine = "sim"`,
`sync.transport = "sim"`); `register()` adds them, which importing `verst.sim.plugin` does."""

from __future__ import annotations

from verst.config.registries import ENGINE_KINDS, WEIGHT_TRANSPORTS, EngineEntry, TransportEntry


def register() -> None:
    """Add both names (once; a second call finds them)."""
    if "sim" not in ENGINE_KINDS:
        ENGINE_KINDS.add("sim", EngineEntry(
            "verst.sim.serve:SIM", "a simulated engine (continuous batching in simulated time; docs/scale.md)",
            transports=("sim",), transport_note="a simulated engine receives declared weights only "
            "(sync.transport = 'sim')", samples_per_request=True, seeds_each_sample=True))
    if "sim" not in WEIGHT_TRANSPORTS:
        WEIGHT_TRANSPORTS.add("sim", TransportEntry(
            "verst.sim.transport:SimTransport", "the distributed transport's requests, each engine charging the "
            "bytes over its link (simulated engines)"))
