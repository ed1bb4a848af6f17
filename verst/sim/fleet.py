"""Many simulated engines on one event loop, each listening on a port of its own, and the fleet's control
routes: put an engine into a fault (die, stall, slow down, refuse loads), halt it, restart it at a version,
read every engine's counters. `python -m verst.sim.fleet --spec JSON --port-file F` runs one fleet process.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import uvloop

from verst.sim.clock import SimClock
from verst.sim.engine import SimEngine
from verst.sim.http import HttpServer, Routes, error
from verst.sim.latency import HARDWARE, EngineCosts, ModelShape
from verst.sim.outputs import OutputModel
from verst.sim.routes import SimFaults, engine_routes

log = logging.getLogger(__name__)
FAULTS = ("die", "stall", "slow", "refuse_loads", "heal")


@dataclasses.dataclass(frozen=True)
class FleetSpec:
    """What a fleet process serves: engines `first` .. `first + count - 1` (their fleet-wide indices) of the
    latency model `costs` (a plain dict of `EngineCosts` inputs), on `host`."""

    count: int
    costs: dict[str, Any]
    speedup: float
    model_path: str
    vocab_size: int
    response_tokens_mean: float
    response_tokens_sigma: float
    max_running: int
    restart_s: float
    first: int = 0
    host: str = "127.0.0.1"
    ports: tuple[int, ...] = ()  # 0 or absent: a free port each
    version: str = "0"  # the weight version the engines start with

    def engine_costs(self) -> EngineCosts:
        c = dict(self.costs)
        model = ModelShape(**c.pop("model"))
        return EngineCosts(model=model, hardware=HARDWARE[c.pop("hardware")], **c)


class EngineSlot:
    """One engine's place in the fleet: its server keeps the port across restarts; `engine` is replaced."""

    def __init__(self, index: int, fleet: SimFleet):
        self.index, self.fleet = index, fleet
        self.faults = SimFaults()
        self.engine: SimEngine | None = None
        self.server: HttpServer | None = None
        self.port = 0
        self.state = "down"  # up | stalled | dead | down

    def current(self) -> SimEngine:
        if self.engine is None:
            raise RuntimeError(f"engine {self.index} is not running")
        return self.engine

    async def gate(self) -> None:
        if self.engine is not None:
            await self.engine.unstalled.wait()

    async def start(self, port: int, version: str) -> None:
        f = self.fleet
        self.engine = SimEngine(self.index, f.costs, f.clock, f.outputs, version=version, max_running=f.spec.max_running)
        routes = Routes(engine_routes(self.current, f.spec.model_path, f.spec.vocab_size, self.faults), self.gate)
        self.server = HttpServer(routes)
        self.port = await self.server.start(f.spec.host, port)
        self.faults.refuse_loads = False
        self.state = "up"

    def halt(self) -> None:
        """Kill it: the port closes, every connection drops, every request it held ends."""
        if self.engine is not None:
            self.engine.unstalled.set()
            self.engine.close()
            self.engine = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        self.state = "dead"

    def fault(self, kind: str, factor: float) -> None:
        engine = self.current()
        if kind == "die":
            self.halt()
        elif kind == "stall":
            engine.unstalled.clear()
            self.state = "stalled"
        elif kind == "slow":
            engine.slow_factor = factor
        elif kind == "refuse_loads":
            self.faults.refuse_loads = True
        else:  # heal
            engine.slow_factor, self.faults.refuse_loads = 1.0, False
            engine.unstalled.set()
            self.state = "up"


class SimFleet:
    def __init__(self, spec: FleetSpec):
        self.spec = spec
        self.clock = SimClock(spec.speedup)
        self.costs = spec.engine_costs()
        self.outputs = OutputModel(spec.response_tokens_mean, spec.response_tokens_sigma)
        self.slots = [EngineSlot(spec.first + i, self) for i in range(spec.count)]
        self.control = HttpServer(Routes(self._control_routes()))

    async def start(self) -> dict[str, Any]:
        ports = list(self.spec.ports) or [0] * self.spec.count
        for slot, port in zip(self.slots, ports):
            await slot.start(port, self.spec.version)
        control = await self.control.start(self.spec.host, 0)
        return {"control": control, "engines": [slot.port for slot in self.slots], "pid": os.getpid()}

    def slot(self, index: int) -> EngineSlot:
        at = index - self.spec.first
        if not 0 <= at < len(self.slots):
            raise KeyError(index)
        return self.slots[at]

    def _control_routes(self) -> dict[str, Any]:
        async def fault(body: Any, _: dict[str, str]) -> tuple[int, Any]:
            kind = body.get("kind") if isinstance(body, dict) else None
            if kind not in FAULTS:
                return error(422, f"kind {kind!r} is not one of {FAULTS}", "kind")
            slot = self._slot_of(body)
            if slot is None or slot.engine is None:
                return error(400, f"index {body.get('index')!r} names no running engine of this fleet", "index")
            slot.fault(kind, float(body.get("factor", 1.0)))
            return 200, {"index": slot.index, "state": slot.state}

        async def halt(body: Any, _: dict[str, str]) -> tuple[int, Any]:
            slot = self._slot_of(body)
            if slot is None:
                return error(400, f"index {body!r} names no engine of this fleet", "index")
            slot.halt()
            return 200, {"index": slot.index, "state": slot.state}

        async def restart(body: Any, _: dict[str, str]) -> tuple[int, Any]:
            slot = self._slot_of(body)
            if slot is None:
                return error(400, f"index {body!r} names no engine of this fleet", "index")
            slot.halt()
            await self.clock.sleep(self.spec.restart_s)  # a real engine's start-up: loading the weights
            await slot.start(slot.port, str(body.get("version", "0")))
            return 200, {"index": slot.index, "port": slot.port, "state": slot.state}

        async def stats(body: Any, _: dict[str, str]) -> tuple[int, Any]:
            return 200, [{"index": s.index, "port": s.port, "state": s.state,
                          **(s.engine.stats() if s.engine is not None else {})} for s in self.slots]

        return {"/fault": fault, "/halt": halt, "/restart": restart, "/stats": stats}

    def _slot_of(self, body: Any) -> EngineSlot | None:
        index = body.get("index") if isinstance(body, dict) else None
        try:
            return self.slot(index) if isinstance(index, int) else None
        except KeyError:
            return None


async def serve(spec: FleetSpec, port_file: Path, single: bool = False) -> None:
    """Serve until SIGTERM; `port_file` gets the ports once every engine listens (`single`: the one engine's
    port alone, as an engine server reports it to `EngineProcess`)."""
    fleet = SimFleet(spec)
    ports = await fleet.start()
    tmp = port_file.with_suffix(".tmp")
    tmp.write_text(str(ports["engines"][0]) if single else json.dumps(ports))
    tmp.replace(port_file)  # the launcher reads it whole
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for slot in fleet.slots:
        slot.halt()
    fleet.control.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verst.sim.fleet", description=__doc__)
    parser.add_argument("--spec", required=True, help="the FleetSpec as JSON")
    parser.add_argument("--port-file", required=True, help="where the ports are written once every engine listens")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    raw = json.loads(args.spec)
    spec = FleetSpec(**{**raw, "ports": tuple(raw.get("ports", ()))})
    uvloop.run(serve(spec, Path(args.port_file)))  # a thousand servers share this loop
    return 0


if __name__ == "__main__":
    sys.exit(main())
